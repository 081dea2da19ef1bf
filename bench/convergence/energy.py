"""Does the gradient's concentration predict ZenFlow's quality? For each convergence workload:
the share of the gradient energy in the top 10% of each matrix's columns and how stable that
set is from step to step (``zenflow_triton.diagnostics``, over the first AdamW steps of the
study's recipe), beside the defaults' measured gap to AdamW in the convergence study
(``data/convergence.json``). The evidence behind ``zenflow-tune diagnose``'s verdict.

    python bench/convergence/energy.py --threads 1 --steps 12
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from study import WORKLOADS  # noqa: E402
from workloads import BUILDERS  # noqa: E402

from zenflow_triton.diagnostics import GradientDiagnostics  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "convergence.json"
DEFAULTS = "zenflow-adaptive-dense"


def gap(rows: list[dict], workload: str) -> tuple[float, float | None, int]:
    """The defaults' held-out loss (and accuracy) minus AdamW's, mean over shared seeds."""
    ref = {r["seed"]: r["final"] for r in rows
           if r["workload"] == workload and r["optimizer"] == "adamw"}
    mine = [r for r in rows if r["workload"] == workload and r["optimizer"] == DEFAULTS
            and r["seed"] in ref]
    if not mine:
        return float("nan"), None, 0
    dl = statistics.mean(r["final"]["loss"] - ref[r["seed"]]["loss"] for r in mine)
    acc = None
    if all("accuracy" in r["final"] for r in mine):
        acc = statistics.mean(r["final"]["accuracy"] - ref[r["seed"]]["accuracy"]
                              for r in mine)
    return dl, acc, len(mine)


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
    return diag.summary()["overall"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = json.loads(DATA.read_text())
    print("| workload | energy in top 10% of columns | overlap with previous step | "
          "defaults - AdamW: loss | accuracy | seeds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for wl in args.workloads:
        c = concentration(wl, args.steps)
        dl, da, n = gap(rows, wl)
        print(f"| {wl} | {c['energy_share']:.3f} | {c['overlap_prev']:.3f} | {dl:+.4f} | "
              f"{'-' if da is None else format(100 * da, '+.1f') + ' pts'} | {n} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
