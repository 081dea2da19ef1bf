"""How many steps a tuning trial needs for the quality guard to separate settings.

The tuner judges a setting by one run of ``--steps`` steps against AdamW's held-out loss on
the same data (the 2% guard). Too short a run and ZenFlow's windows have not caught up yet:
the library's defaults fail the guard only because the trial stopped early (``--steps 20``
saved no profile on a user's workload), and AdamW's own seeds may differ by more than the
settings do. For each step count: AdamW's held-out loss over seeds 0-2 (its spread), and
each setting's loss on seed 0 as a fraction of the guard's allowance used (``excess /
(margin x AdamW)``: <= 1 passes), on the tuner's embedded workload (``tinylm-ft``, lr 3e-4,
the tuner's defaults otherwise) or another ``--workload``.

    python bench/convergence/trial_steps.py --threads 1             # about 5 min on 2 cores
    python bench/convergence/trial_steps.py --steps 20 60 --settings 0.1x4 0.02x8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.objective import TuneSettings, train_and_measure  # noqa: E402
from autotune.training import load_workload_factory  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def setting(text: str) -> dict:
    """``"0.1x4"`` -> topk_ratio=0.1, update_interval=4."""
    k, n = text.split("x")
    return dict(topk_ratio=float(k), update_interval=int(n))


def loss(factory, ts: TuneSettings, zenflow: dict | None) -> float:
    def make(params):
        if zenflow is None:
            return torch.optim.AdamW(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                                     weight_decay=ts.weight_decay)
        return ZenFlowOptimizer(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                                weight_decay=ts.weight_decay,
                                **{"fresh_if_spread": False, **zenflow})
    return train_and_measure(factory, make, ts).heldout_loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 40, 60, 120])
    ap.add_argument("--settings", nargs="+", default=["0.1x4", "0.1x16", "0.02x8", "0.01x16"])
    ap.add_argument("--workload", default=None, help="module:function (default: tinylm-ft)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name, factory = load_workload_factory(args.workload)
    print(f"{name}: held-out loss after each step count; settings on seed 0 as the share of "
          "the 2% guard's allowance they use (<= 1.00 passes)")
    print()
    print("| steps | AdamW seeds 0-2 | AdamW sd / allowance | "
          + " | ".join(args.settings) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in args.settings) + " |")
    for steps in args.steps:
        runs = [TuneSettings(workload=name, device="cpu", steps=steps, seed=s,
                             skip_steps=min(5, steps - 1)) for s in range(3)]
        ref = [loss(factory, ts, None) for ts in runs]
        allowance = runs[0].loss_margin * abs(ref[0])
        cells = []
        for s in args.settings:
            z = loss(factory, runs[0], setting(s))
            cells.append(f"{(z - ref[0]) / allowance:+.2f}")
        print(f"| {steps} | {', '.join(f'{x:.4f}' for x in ref)} | "
              f"{statistics.stdev(ref) / allowance:.2f} | " + " | ".join(cells) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
