"""The equivalences of DESIGN.md, over 30 steps on a model with mixed param shapes, with weight
decay, two param groups and an LR scheduler that starts at 0."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer

from .helpers import (batches, loss_fn, make_model, param_groups, params_of, train,
                      warmup_lambda)
from . import reference

STEPS = 30


def run_adamw(data, dtype=torch.float32):
    model = make_model(dtype=dtype)
    opt = torch.optim.AdamW(param_groups(model), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
    return params_of(train(model, opt, data, sched))


def run_zenflow(data, dtype=torch.float32, zero_grad_via_model=False, **cfg):
    model = make_model(dtype=dtype)
    cfg.setdefault("min_offload_numel", 64)
    with ZenFlowOptimizer(param_groups(model), **cfg) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
        train(model, opt, data, sched, zero_grad_via_model=zero_grad_via_model)
        opt.synchronize()
        stats = opt.stats()
    return params_of(model), stats


def assert_params_close(got, want, rtol=1e-6):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=1e-8)


def test_topk_one_equals_adamw():
    data = batches(STEPS)
    got, stats = run_zenflow(data, topk_ratio=1.0, update_interval=4)
    assert stats["device_owned_fraction"] == 1.0
    assert stats["host_updates"] == 0
    assert_params_close(got, run_adamw(data))


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.3, 0.7, 1.0])
def test_interval_one_no_overlap_equals_adamw(ratio):
    data = batches(STEPS)
    # Reselect every 3 steps so columns migrate between owners during the run.
    got, stats = run_zenflow(data, topk_ratio=ratio, update_interval=1, select_interval=3,
                             overlap=False, zero_grad_via_model=True)
    if 0.0 < ratio < 1.0:
        assert stats["columns_migrated"] > 0
    assert_params_close(got, run_adamw(data))


def test_zero_offload_mode_updates_everything_on_host():
    data = batches(8)
    got, stats = run_zenflow(data, topk_ratio=0.0, update_interval=1, overlap=False)
    assert stats["host_updates"] == 8
    assert_params_close(got, run_adamw(data))


def test_deferred_schedule_differs_from_adamw():
    """Guards the tests above: with a real window the trajectory is not AdamW's."""
    data = batches(12)
    got, _ = run_zenflow(data, topk_ratio=0.2, update_interval=4, overlap=True)
    want = run_adamw(data)
    assert any(not torch.allclose(g, w, rtol=1e-4) for g, w in zip(got, want))


def run_reference(data, dtype=torch.float32, **cfg):
    model = make_model(dtype=dtype)
    reference.run_reference(model, data, loss_fn, param_groups(model), warmup_lambda, **cfg)
    return params_of(model)


SCHEDULES = [
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True),
    dict(topk_ratio=0.1, update_interval=3, select_interval=6, overlap=False),
    dict(topk_ratio=0.3, update_interval=2, select_interval=4, overlap=True, warmup_steps=5),
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
         host_lr_scale=1.0),
    # every column host-owned, synchronous: the job streams the accumulator piece by piece
    # and writes the params itself
    dict(topk_ratio=0.0, update_interval=2, select_interval=4, overlap=False),
]


@pytest.mark.parametrize("cfg", SCHEDULES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_async_schedule_matches_single_threaded_reference(cfg):
    data = batches(STEPS)
    got, stats = run_zenflow(data, host_threads=2, chunk_size=97, **cfg)
    assert stats["host_updates"] > 0 and stats["selection_refreshes"] >= 3
    ref_cfg = {k: v for k, v in cfg.items()}
    assert_params_close(got, run_reference(data, **ref_cfg))


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_overlap_runs_are_bit_identical(accumulate_on):
    data = batches(STEPS)
    cfg = dict(topk_ratio=0.15, update_interval=4, select_interval=8, overlap=True,
               accumulate_on=accumulate_on)
    a, _ = run_zenflow(data, host_threads=2, chunk_size=50, **cfg)
    b, _ = run_zenflow(data, host_threads=1, chunk_size=1 << 20, **cfg)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=True),
    dict(topk_ratio=0.0, update_interval=1, select_interval=4, overlap=False),  # job stores
], ids=["overlap", "zero-offload"])
def test_bf16_params_follow_reference(cfg):
    data = batches(16)
    got, _ = run_zenflow(data, dtype=torch.bfloat16, **cfg)
    want = run_reference(data, dtype=torch.bfloat16, **cfg)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
    # bf16 params keep fp32 masters: the params are the masters rounded, nothing more.
    assert sum((g != w).sum().item() for g, w in zip(got, want)) <= sum(g.numel() for g in got) // 100


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap=True),
    dict(topk_ratio=0.0, update_interval=1, select_interval=4, overlap=True),  # .grad itself
], ids=["accumulator-on-loan", "grad-on-loan"])
def test_slow_copy_in_cannot_race_the_training_loop(cfg, monkeypatch):
    """The host job copies the window's gradient off its sources itself. Make that copy slow:
    if the next accumulation (or the caller zeroing .grad in place) did not wait for it, the
    job would copy the wrong numbers and the trajectory would leave the reference's."""
    import time as _time

    from zenflow_triton.transfer import CopyQueue

    real = CopyQueue.copy
    calls = []

    def slow(self, dst, src):
        calls.append(1)
        _time.sleep(0.02)
        return real(self, dst, src)

    monkeypatch.setattr(CopyQueue, "copy", slow)
    data = batches(12)
    model = make_model()
    with ZenFlowOptimizer(param_groups(model), min_offload_numel=64, **cfg) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
        for x in data:
            loss_fn(model, x).backward()
            opt.step()
            sched.step()
            for p in model.parameters():  # in place, as zero_grad(set_to_none=False) does
                p.grad.zero_()
        opt.synchronize()
    monkeypatch.undo()
    assert calls  # the copies went through the slowed path
    assert_params_close(params_of(model), run_reference(data, **cfg))
