"""Column age: how long a column of a split matrix stays host-owned, under a setting.

Trains a workload of ``workloads.py`` with ZenFlow and reads, after every step, which columns
each split matrix keeps on the device (``device_idx``, part of the optimizer's state dict).
A column's *age* at a step is the number of steps since it was last device-owned (or since
the start). Reported per setting: the share of columns never device-owned in the run, the
mean age over columns and steps, the oldest age at the end, and the number of selections.

    python bench/convergence/column_age.py --workload tinylm-ft --steps 200 \\
        --settings 0.02x8 0.02x8/sel2 0.1x4 0.1x4/sel2

A setting ``KxN`` is ``topk_ratio=K, update_interval=N`` (the other fields default);
``/selW`` adds ``select_interval=W*N``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workloads import BUILDERS  # noqa: E402

from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def parse_setting(text: str) -> dict:
    """``"0.02x8/sel2"`` -> ``{"topk_ratio": 0.02, "update_interval": 8,
    "select_interval": 16}``."""
    main, _, sel = text.partition("/")
    k, ui = main.split("x")
    out = dict(topk_ratio=float(k), update_interval=int(ui))
    if sel:
        if not sel.startswith("sel"):
            raise ValueError(f"bad setting {text!r}: expected KxN or KxN/selW")
        out["select_interval"] = int(sel[3:]) * out["update_interval"]
    return out


def measure(workload: str, setting: dict, steps: int, lr: float, seed: int = 0) -> dict:
    job = BUILDERS[workload](seed)
    named = [(n, p) for n, p in job.model.named_parameters() if p.requires_grad]
    opt = ZenFlowOptimizer(named, lr=lr, weight_decay=0.01, host_lr_scale="adaptive",
                           **{"fresh_if_spread": False, **setting})
    ages: dict[torch.Tensor, np.ndarray] = {}
    ever: dict[torch.Tensor, np.ndarray] = {}
    age_sum = 0.0
    samples = 0
    try:
        for _ in range(steps):
            loss = job.loss_fn(job.model, next(job.batches))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in named], 1.0)
            opt.step()
            for _, p in named:
                st = opt.state.get(p)
                if not isinstance(st, dict) or st.get("kind") != "matrix":
                    continue
                cols = st["host_idx"].numel() + st["device_idx"].numel()
                age = ages.setdefault(p, np.zeros(cols))
                seen = ever.setdefault(p, np.zeros(cols, dtype=bool))
                on_dev = st["device_idx"].cpu().numpy()
                age += 1
                age[on_dev] = 0
                seen[on_dev] = True
                age_sum += age.sum()
                samples += cols
        stats = opt.stats()
    finally:
        opt.close()
    total = sum(a.size for a in ages.values())
    never = sum(int((~s).sum()) for s in ever.values())
    return dict(setting=setting, never_device=never / total if total else 0.0,
                mean_age=age_sum / samples if samples else 0.0,
                oldest=max(int(a.max()) for a in ages.values()) if ages else 0,
                selections=stats["selection_refreshes"], columns=total)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tinylm-ft", choices=list(BUILDERS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--settings", nargs="+", default=["0.02x8", "0.02x8/sel2", "0.1x4",
                                                      "0.1x4/sel2"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.workload}, {args.steps} steps, lr {args.lr}: columns of the split matrices")
    print("| setting | selections | never device-owned | mean age (steps) | oldest at the end |")
    print("| --- | --- | --- | --- | --- |")
    for text in args.settings:
        r = measure(args.workload, parse_setting(text), args.steps, args.lr)
        print(f"| {text} | {r['selections']} | {100 * r['never_device']:.1f}% "
              f"| {r['mean_age']:.1f} | {r['oldest']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
