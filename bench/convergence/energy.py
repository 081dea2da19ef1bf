"""Does the gradient's concentration predict ZenFlow's quality? For each convergence workload:
the share of the gradient energy in the top 10% of each matrix's columns and how stable that
set is from step to step (``zenflow_triton.diagnostics``, over the first AdamW steps of the
study's recipe), the share the optimizer itself measures at its first selection
(``stats()["spread"]``, what ``fresh_if_spread`` acts on), beside the default schedule's
measured gap to AdamW at every learning rate the tuner's store has
(``autotune/data/real_quality.json``, class ``zenflow-adaptive-dense``). The evidence behind
``fresh_if_spread``, its warning and ``zenflow-tune diagnose``'s verdict; ``--json`` keeps it
(``tests/test_spread.py`` checks the rule against it).

    python bench/convergence/energy.py --threads 1 --steps 12 --json bench/convergence/data/energy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from study import WORKLOADS  # noqa: E402
from workloads import BUILDERS  # noqa: E402

from zenflow_triton.config import ZenFlowConfig  # noqa: E402
from zenflow_triton.diagnostics import GradientDiagnostics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "autotune" / "data" / "real_quality.json"
DEFAULTS = "zenflow-adaptive-dense"


def gaps(workload: str) -> list[dict]:
    """The default schedule's results in the store for ``workload`` (each lr it has: entries
    ``workload`` and ``workload@lr``): loss and accuracy (points) minus AdamW's, seeds."""
    store = json.loads(STORE.read_text())
    out = []
    for entry in store["entries"]:
        if entry["name"] != DEFAULTS:
            continue
        for key, r in entry["results"].items():
            if key.split("@")[0] == workload:
                out.append(dict(entry=key, loss=r["loss_delta"],
                                accuracy=r.get("accuracy_delta_pts"), seeds=r["seeds"]))
    return out


def concentration(workload: str, steps: int) -> dict:
    lr, _, _, options, *_ = WORKLOADS[workload]
    job = BUILDERS[workload](0, **options)
    model = job.model
    model.train()
    diag = GradientDiagnostics(model.named_parameters(), topk_ratio=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        job.loss_fn(model, next(job.batches)).backward()
        diag.record()
        opt.step()
    out = dict(diag.summary()["overall"])
    # the first step's share over the matrices the defaults split (the dense set left out):
    # the concentration the deferred columns themselves have
    dense = ZenFlowConfig().is_dense
    split = [r for r in diag.layers if r.energy_share and not dense(r.name)]
    sizes = [torch.Size(r.shape).numel() for r in split]
    out["split_first_step"] = sum(n * r.energy_share[0] for n, r in zip(sizes, split)) / sum(sizes)
    return out


def first_selection_share(workload: str) -> float:
    """What ``ZenFlowOptimizer`` measures at its first selection on the workload (seed 0, the
    study's defaults: named params, so the dense set is as a user gets it)."""
    from zenflow_triton import ZenFlowOptimizer

    lr, _, _, options, *_ = WORKLOADS[workload]
    job = BUILDERS[workload](0, **options)
    job.model.train()
    opt = ZenFlowOptimizer(job.model.named_parameters(), lr=lr, weight_decay=0.01)
    job.loss_fn(job.model, next(job.batches)).backward()
    opt.step()
    share = opt.stats()["spread"]["share"]
    opt.close(finish=False)
    return share


def _shown(path: str) -> str:
    """``path`` as the command is written from the repository root, where it lies inside."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write (merge) the rows into this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {}
    if args.json and Path(args.json).exists():
        rows = json.loads(Path(args.json).read_text())["workloads"]
    print("| workload | first selection: top 10% share | AdamW's first steps: top 10% share "
          "| split matrices only, first step | overlap with previous step "
          "| default schedule - AdamW (loss, accuracy, seeds) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for wl in args.workloads:
        c = concentration(wl, args.steps)
        first = first_selection_share(wl)
        rows[wl] = {"first_selection_share": first, "energy_share": c["energy_share"],
                    "split_first_step": c["split_first_step"],
                    "overlap_prev": c["overlap_prev"], "steps": args.steps}
        found = "; ".join(
            f"{g['entry']}: {g['loss']:+.4f}"
            + ("" if g.get("accuracy") is None else f", {g['accuracy']:+.1f} pts")
            + f" ({len(g['seeds'])})" for g in gaps(wl)) or "-"
        print(f"| {wl} | {first:.3f} | {c['energy_share']:.3f} | {c['split_first_step']:.3f} "
              f"| {c['overlap_prev']:.3f} "
              f"| {found} |", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "command": "python bench/convergence/energy.py --threads 1 --steps "
                           f"{args.steps} --json {_shown(args.json)}",
                "seed": 0, "workloads": dict(sorted(rows.items()))}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
