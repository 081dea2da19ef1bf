"""The optimizer on the Triton backend (interpreted on CPU): the same trajectory as the torch
backend to fp32 rounding (two implementations: helpers.fp32_run_tol, on a seeded gradient
feed), and topk_ratio=1.0 still equals torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

from .support.helpers import (FeedModel, GradFeed, assert_trajectories_close, fp32_masters,
                              param_groups, params_of, train_feed)

pytestmark = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])

STEPS = 10
LR = 1e-2
# On a GPU machine the kernels run compiled on CUDA tensors (bench/gpu_check.sh); on a CPU
# one, in the interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run(backend, feed, dtype=torch.float32, **cfg):
    model = FeedModel(dtype, device=DEVICE)
    with ZenFlowOptimizer(param_groups(model, lr=LR), backend=backend, min_offload_numel=64,
                          **cfg) as opt:
        assert opt.backend == backend
        train_feed(model, opt, feed)
        opt.synchronize()
        stats = opt.stats()
        masters = fp32_masters(opt, list(model.parameters()))
    return [p.cpu() for p in params_of(model)], masters, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_follows_torch_backend(dtype):
    """fp32: the params agree to fp32 rounding. bf16: the fp32 masters agree to fp32
    rounding and each bf16 param is its own master rounded, so a kernel that dropped the
    master (updating the bf16 value itself) fails by bf16 rounding, far outside the bound."""
    cfg = dict(topk_ratio=0.2, update_interval=2, select_interval=4, overlap=True)
    feed = GradFeed(STEPS, pull=0.5 if dtype == torch.float32 else 0.0, grid=dtype)
    got, got_m, s1 = run("triton", feed, dtype=dtype, **cfg)
    want, want_m, s2 = run("torch", feed, dtype=dtype, **cfg)
    assert s1["columns_migrated"] > 0 and s1["columns_migrated"] == s2["columns_migrated"]
    lr = LR * cfg["update_interval"]
    assert_trajectories_close(got_m, want_m, STEPS, lr, what="fp32 master")
    for p, m in zip(got, got_m):
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))


def test_triton_topk_one_equals_adamw():
    feed = GradFeed(STEPS)
    got, _, _ = run("triton", feed, topk_ratio=1.0)
    model = FeedModel(device=DEVICE)
    train_feed(model, torch.optim.AdamW(param_groups(model, lr=LR), foreach=False), feed)
    assert_trajectories_close(got, [p.cpu() for p in params_of(model)], STEPS, LR)
