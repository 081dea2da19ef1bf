"""Optimizer step time: ZenFlow vs torch.optim.AdamW(fused=True) vs the ZeRO-Offload mode.

The model is a stack of square Linear layers (>= 20M params; ZENFLOW_BENCH_QUICK=1 shrinks it
so CI runs the suite in seconds). Gradients are fixed random tensors, so only step() is
timed. ZenFlow's cost depends on where a step falls in its window, so one round is a whole
window of ``update_interval`` steps, reported per step. Ratios are against fused AdamW
measured in the same run.
"""

from __future__ import annotations

import os
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
    return _report.linear_stack(WIDTH, LAYERS)


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


# --- Python/dispatch time per step against the number of params ------------------------------
# Tiny tensors (Linear(32, 32) layers: a 32x32 matrix and a bias each), so a step's time is
# Python, dispatch and launch overhead, not arithmetic: how it grows with the number of params
# is what a GPU step would pay on the host before the device gets its work. The Triton backend
# runs in the interpreter on CPU, so its figure here also holds the interpreter's own work
# per launch (a GPU launch is asynchronous); the count of its launches does not grow.
DISPATCH_LAYERS = (8, 32) if _report.QUICK else (16, 64, 256)
DISPATCH_ROUNDS = 2 if _report.QUICK else 5


def _dispatch_cases():
    from zenflow_triton.kernels import triton_available

    cases = {"adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
             "zenflow_torch": lambda ps: ZenFlowOptimizer(ps, lr=1e-4, topk_ratio=0.25,
                                                          update_interval=WINDOW,
                                                          min_offload_numel=64,
                                                          backend="torch")}
    if triton_available()[0]:
        cases["zenflow_triton"] = lambda ps: ZenFlowOptimizer(
            ps, lr=1e-4, topk_ratio=0.25, update_interval=WINDOW, min_offload_numel=64,
            backend="triton")
        # The same, with the multi-tensor kernels' launches stubbed out: what the host pays
        # per step on the Triton path (tables, Python, dispatch), as on a GPU where a launch
        # returns at once; the numbers it computes are wrong and unused.
        cases["zenflow_triton_host"] = cases["zenflow_triton"]
    return cases


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_multi_launches(monkeypatch) -> None:
    from zenflow_triton.kernels import adamw, scatter_multi, selective_adamw_multi

    for mod, name in ((selective_adamw_multi, "_selective_adamw_accumulate_kernel"),
                      (adamw, "_adamw_multi_kernel"),
                      (scatter_multi, "_scatter_columns_multi_kernel")):
        monkeypatch.setattr(mod, name, _NoLaunch())


@pytest.mark.parametrize("layers", DISPATCH_LAYERS)
@pytest.mark.parametrize("case", list(_dispatch_cases()))
def test_dispatch_time_per_step(benchmark, case, layers, monkeypatch):
    if case == "zenflow_triton_host":
        _stub_multi_launches(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = _dispatch_cases()[case](model.parameters())
    for _ in range(2 * WINDOW):  # state, selection, a first applied window
        opt.step()

    def window():
        for _ in range(WINDOW):
            opt.step()

    benchmark.pedantic(window, rounds=DISPATCH_ROUNDS, iterations=1, warmup_rounds=1)
    if hasattr(opt, "close"):
        opt.close()
    per_step = statistics.median(benchmark.stats.stats.data) / WINDOW
    n_params = 2 * layers
    key = f"dispatch_{case}_{layers}"
    RESULTS[key] = per_step
    base = RESULTS.get(f"dispatch_adamw_fused_{layers}")
    ratio = f"{per_step / base:6.1f}x fused AdamW" if base else "baseline"
    interp = case == "zenflow_triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if case == "zenflow_triton_host":
        ratio += "  (multi-tensor launches stubbed: the host's share)"
    _report.add({"suite": "dispatch", "case": case, "params": n_params,
                 "seconds_per_step": per_step, "triton_interpreter": interp,
                 "ratio_vs_adamw_fused": per_step / base if base else 1.0},
                f"dispatch {case:<15} {n_params:4d} params  {per_step * 1e6:9.1f} us/step  "
                f"{per_step * 1e6 / n_params:7.2f} us/param  {ratio}"
                + ("  (Triton interpreter: mostly its own per-program work)" if interp else ""))
