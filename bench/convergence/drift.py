"""How far does the gradient turn within one host window? For each workload and learning rate:
the split matrices' weight RMS and the step travel the optimizer measures at its first
selection (``lr / rms``: Adam's unit step per element against the weights' size; times
``update_interval`` the window travel, ``columns.spread``), then, over the study's recipe with
AdamW (peak lr, no warm-up, clipping at 1.0), how much the gradient of the split matrices on
one fixed batch changes after 1, 2, 4 and 8 steps (``|g_k - g_0| / |g_0|``, its cosine, and
the same over each matrix's 90% of columns with the least energy at step 0: the host-owned
ones), beside the minibatch noise at step 0 (two batches' gradients, same measure). A window's
host update is computed from gradients that the steps since have turned away from: the
mechanism behind the stale schedule's loss where the share does not flag it (Gemma 3 270M;
docs/quality.md, "The window's travel").

    python bench/convergence/drift.py --threads 1 --runs smollm2 smollm2@1e-4 gemma3 \\
        minilm-tweets --json bench/convergence/data/drift.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from study import WORKLOADS  # noqa: E402
from workloads import BUILDERS  # noqa: E402

from zenflow_triton.config import ZenFlowConfig  # noqa: E402
from zenflow_triton.state import MATRIX, classify  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAGS = (1, 2, 4, 8)


def _norm(gs) -> float:
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs))


def _dot(a, b) -> float:
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


def measure(workload: str, lr: float) -> dict:
    """One workload at one lr (seed 0): see the module's docstring."""
    options = WORKLOADS[workload][3]
    job = BUILDERS[workload](0, **options)
    model = job.model
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    split = [p for n, p in named if classify(p, ZenFlowConfig(), n) == MATRIX]
    fixed, other = next(job.batches), next(job.batches)
    model.zero_grad(set_to_none=True)
    job.loss_fn(model, fixed).backward()
    split = [p for p in split if p.grad is not None]  # as the optimizer: those with a gradient

    def grads(batch):
        model.zero_grad(set_to_none=True)
        job.loss_fn(model, batch).backward()
        return [p.grad.detach().clone() for p in split]

    t0 = time.perf_counter()
    g0, g_other = grads(fixed), grads(other)
    host = []  # each matrix's 90% of columns with the least energy at step 0
    for g in g0:
        energy = g.pow(2).sum(0)
        keep = torch.ones_like(energy, dtype=torch.bool)
        keep[energy.topk(max(1, int(0.1 * energy.numel()))).indices] = False
        host.append(keep)

    def cols(gs):
        return [g[:, m] for g, m in zip(gs, host)]

    def change(a, b, part=lambda gs: gs):
        a, b = part(a), part(b)
        return _norm([x - y for x, y in zip(a, b)]) / _norm(b)

    numel = sum(p.numel() for p in split)
    rms = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in split) / numel)
    out = dict(workload=workload, lr=lr, seed=0, split_params=numel, weight_rms=rms,
               step_travel=lr / rms, window_travel=lr / rms * ZenFlowConfig().update_interval,
               noise=change(g_other, g0), noise_host=change(g_other, g0, cols))
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    out["drift"] = {}
    for k in range(1, max(LAGS) + 1):
        opt.zero_grad(set_to_none=True)
        job.loss_fn(model, next(job.batches)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if k in LAGS:
            gk = grads(fixed)
            out["drift"][str(k)] = dict(
                change=change(gk, g0), change_host=change(gk, g0, cols),
                cosine=_dot(gk, g0) / (_norm(gk) * _norm(g0)))
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True,
                    help="WORKLOAD or WORKLOAD@LR (the workload's own lr without @)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write (merge) the rows into this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {}
    if args.json and Path(args.json).exists():
        rows = json.loads(Path(args.json).read_text())["rows"]
    print("| workload | lr | weight RMS | window travel | noise | change after 1 / 2 / 4 / 8 "
          "steps | cosine after 4 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in args.runs:
        workload, _, lr = run.partition("@")
        if workload not in WORKLOADS:
            ap.error(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
        lr = float(lr) if lr else WORKLOADS[workload][0]
        r = measure(workload, lr)
        rows[f"{workload}@{lr:g}"] = r
        d = r["drift"]
        print(f"| {workload} | {lr:g} | {r['weight_rms']:.4f} | {r['window_travel']:.2e} "
              f"| {r['noise']:.2f} | " + " / ".join(f"{d[str(k)]['change']:.2f}" for k in LAGS)
              + f" | {d['4']['cosine']:.3f} |", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": "python bench/convergence/drift.py --threads 1 --runs "
                           + " ".join(sorted(rows)) + " --json bench/convergence/data/drift.json",
                "rows": dict(sorted(rows.items()))}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
