"""Optimizer step time: ZenFlow vs torch.optim.AdamW(fused=True) vs the ZeRO-Offload mode.

The model is a stack of square Linear layers (>= 20M params; ZENFLOW_BENCH_QUICK=1 shrinks it
so CI runs the suite in seconds). Gradients are fixed random tensors, so only step() is
timed. ZenFlow's cost depends on where a step falls in its window, so one round is a whole
window of ``update_interval`` steps, reported per step. Ratios are against fused AdamW
measured in the same run.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import nn

import _report
from zenflow_triton import ZenFlowOptimizer

WIDTH, LAYERS = (256, 4) if _report.QUICK else (2048, 5)
ROUNDS = 3 if _report.QUICK else 15
WINDOW = 4
RESULTS: dict[str, float] = {}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return model


CASES = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "zenflow_k0.1_u4": lambda ps: ZenFlowOptimizer(ps, lr=1e-4, topk_ratio=0.1,
                                                   update_interval=WINDOW, overlap=True),
    "zero_offload_mode": lambda ps: ZenFlowOptimizer(ps, lr=1e-4, topk_ratio=0.0,
                                                     update_interval=1, overlap=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_optimizer_step(benchmark, case):
    model = make_model()
    numel = sum(p.numel() for p in model.parameters())
    opt = CASES[case](model.parameters())
    for _ in range(WINDOW):  # allocate state, first selection, first window
        opt.step()

    def window():
        for _ in range(WINDOW):
            opt.step()

    benchmark.pedantic(window, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    per_step = statistics.median(benchmark.stats.stats.data) / WINDOW
    RESULTS[case] = per_step
    stats = opt.stats() if hasattr(opt, "stats") else {}
    if hasattr(opt, "close"):
        opt.close()
    benchmark.extra_info.update(params=numel, seconds_per_step=per_step,
                                elements_per_s=numel / per_step)
    base = RESULTS.get("adamw_fused")
    ratio = f"{per_step / base:5.2f}x fused AdamW" if base else "baseline"
    link = ""
    if stats:
        steps = stats["steps"]
        param_bytes = numel * 4
        link = (f", link {(stats['bytes_device_to_host'] + stats['bytes_host_to_device']) / steps / param_bytes:.2f}"
                f"x param bytes/step")
    _report.add({"suite": "step", "case": case, "params": numel, "seconds_per_step": per_step,
                 "ratio_vs_adamw_fused": per_step / base if base else 1.0},
                f"step  {case:<18} {numel / 1e6:6.2f}M params  {per_step * 1e3:8.2f} ms/step  "
                f"{numel / per_step / 1e9:6.3f} G elem/s  {ratio}{link}")
