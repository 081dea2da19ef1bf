"""The optimizer on the Triton backend (interpreted on CPU): same trajectory as the torch
backend, and topk_ratio=1.0 still equals torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

from .helpers import batches, make_model, param_groups, params_of, train

pytestmark = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])


def run(backend, steps=10, dtype=torch.float32, **cfg):
    model = make_model(dtype=dtype)
    with ZenFlowOptimizer(param_groups(model), backend=backend, min_offload_numel=64,
                          **cfg) as opt:
        assert opt.backend == backend
        train(model, opt, batches(steps))
        opt.synchronize()
        stats = opt.stats()
    return params_of(model), stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_follows_torch_backend(dtype):
    cfg = dict(topk_ratio=0.2, update_interval=2, select_interval=4, overlap=True)
    got, s1 = run("triton", dtype=dtype, **cfg)
    want, s2 = run("torch", dtype=dtype, **cfg)
    assert s1["columns_migrated"] > 0 and s1["columns_migrated"] == s2["columns_migrated"]
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_triton_topk_one_equals_adamw():
    got, _ = run("triton", topk_ratio=1.0)
    model = make_model()
    train(model, torch.optim.AdamW(param_groups(model), foreach=False), batches(10))
    for a, b in zip(got, params_of(model)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
