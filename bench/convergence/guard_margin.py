"""Why the tuner's quality guard is a 2% margin: the seed-to-seed spread of AdamW's held-out
loss on the embedded workload, next to what ZenFlow's defaults lose, at two learning rates.

For each lr: ``torch.optim.AdamW`` on the embedded fine-tuning workload (``tinylm-ft``,
60 steps, the tuner's quick study) with seeds 0-4: mean, standard deviation and relative
standard deviation of the held-out loss; then ZenFlow's defaults on seed 0 and their excess
over AdamW's seed-0 loss, with ``overlap=True`` (the default) and ``overlap=False``.

    python bench/convergence/guard_margin.py            # about a minute on 2 cores
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.training import heldout_loss, tiny_lm_finetune  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402

STEPS = 60


def train(lr: float, seed: int, zenflow: dict | None) -> float:
    torch.manual_seed(seed)
    wl = tiny_lm_finetune(seed=seed)
    params = wl.model.parameters()
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=0.01) if zenflow is None
           else ZenFlowOptimizer(params, lr=lr, weight_decay=0.01,
                                      **{"fresh_if_spread": False, **zenflow}))
    it = iter(wl.batches)
    for _ in range(STEPS):
        wl.loss_fn(wl.model, next(it)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if zenflow is not None:
        opt.synchronize()
        opt.close()
    return heldout_loss(wl)


def main() -> int:
    print("| lr | AdamW held-out loss, seeds 0-4 | mean | sd | sd / mean | ZenFlow defaults "
          "(seed 0) vs AdamW | defaults with overlap=False |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lr in (3e-4, 1e-3):
        xs = [train(lr, s, None) for s in range(5)]
        m, sd = statistics.mean(xs), statistics.stdev(xs)
        zf = train(lr, 0, {})
        sync = train(lr, 0, dict(overlap=False))
        print(f"| {lr:g} | {', '.join(f'{x:.4f}' for x in xs)} | {m:.4f} | {sd:.4f} | "
              f"{100 * sd / m:.2f}% | {zf:.4f} ({100 * (zf / xs[0] - 1):+.1f}%) | "
              f"{sync:.4f} ({100 * (sync / xs[0] - 1):+.1f}%) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
