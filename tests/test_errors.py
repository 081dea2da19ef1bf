"""Bad input fails fast, names the problem, and loses no state; no wait can hang."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import zenflow_triton.host.adamw as host_adamw
from zenflow_triton import (ConfigError, HostWorkerError, NonFiniteGradientError,
                            ZenFlowConfig, ZenFlowOptimizer)

from zenflow_triton.kernels import triton_available

from .support.helpers import batches, loss_fn, make_model, params_of


@pytest.mark.parametrize("field,value,match", [
    ("topk_ratio", -0.1, r"topk_ratio must be \[0, 1\]"),
    ("topk_ratio", 1.5, r"topk_ratio must be \[0, 1\]"),
    ("topk_ratio", float("nan"), "topk_ratio"),
    ("update_interval", 0, "update_interval must be >= 1"),
    ("update_interval", 2.5, "update_interval must be an int"),
    ("select_interval", 6, "select_interval=6 must be a positive multiple of update_interval=4"),
    ("select_interval", 0, "select_interval must be a positive multiple"),
    ("chunk_size", 0, "chunk_size must be >= 1"),
    ("backend", "cuda", r"backend must be one of \['auto', 'torch', 'triton'\]"),
    ("score", "l3", r"score must be one of \['l2', 'l1'\]"),
    ("accumulate_on", "gpu", r"accumulate_on must be one of \['device', 'host'\]"),
    ("host_state_dtype", "float16", r"host_state_dtype must be one of \['float32', 'bfloat16'\]"),
    ("accumulator_dtype", "fp8", r"accumulator_dtype must be one of \['float32', 'bfloat16'\]"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("host_threads", 0, "host_threads must be >= 1"),
    ("host_lr_scale", 0.0, "host_lr_scale must be > 0"),
    ("host_betas", "steps", r"host_betas must be one of \['step', 'window'\]"),
    ("overlap", "yes", "overlap must be a bool"),
    ("apply_delay", 0, r"apply_delay must be in \[1, update_interval=4\] or None, got 0"),
    ("apply_delay", 5, r"apply_delay must be in \[1, update_interval=4\] or None, got 5"),
    ("apply_delay", 2.0, "apply_delay must be an int"),
])
def test_bad_config_names_field_and_range(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ZenFlowConfig(**{field: value})
    with pytest.raises(ConfigError, match=match):
        ZenFlowOptimizer(make_model().parameters(), **{field: value})


def test_unknown_keyword_and_config_plus_fields():
    with pytest.raises(TypeError, match="topk"):
        ZenFlowOptimizer(make_model().parameters(), topk=0.1)
    with pytest.raises(TypeError, match="not both"):
        ZenFlowOptimizer(make_model().parameters(), config=ZenFlowConfig(), topk_ratio=0.2)


def test_apply_delay_needs_overlap():
    with pytest.raises(ConfigError, match="apply_delay needs overlap=True"):
        ZenFlowConfig(overlap=False, apply_delay=1)
    assert ZenFlowConfig(apply_delay=None).effective_apply_delay == 4
    assert ZenFlowConfig(update_interval=8, apply_delay=3).effective_apply_delay == 3


def test_select_interval_default_is_multiple():
    cfg = ZenFlowConfig(update_interval=3)
    assert cfg.effective_select_interval % 3 == 0


def test_param_in_two_groups_rejected():
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="more than one parameter group"):
        ZenFlowOptimizer([{"params": [lin.weight]}, {"params": [lin.weight, lin.bias]}])


def test_sparse_gradient_rejected():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = ZenFlowOptimizer(emb.parameters(), min_offload_numel=1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradient"):
        opt.step()
    opt.close()


def test_complex_param_rejected():
    p = nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex"):
        ZenFlowOptimizer([p])


def test_nonfinite_gradient_raises_before_any_change_and_optimizer_survives():
    model = make_model()
    data = batches(4)
    opt = ZenFlowOptimizer(list(model.named_parameters()), topk_ratio=0.2, update_interval=2,
                           min_offload_numel=64)
    for x in data[:3]:
        opt.zero_grad()
        loss_fn(model, x).backward()
        opt.step()
    opt.zero_grad()
    loss_fn(model, data[3]).backward()
    model.fc1.weight.grad[1, 2] = float("nan")
    before_params = params_of(model)
    before_acc = {id(p): st["acc"].clone() for p, st in opt.state.items() if "acc" in st}
    with pytest.raises(NonFiniteGradientError, match="'fc1.weight'"):
        opt.step()
    assert opt.stats()["steps"] == 3
    for a, b in zip(params_of(model), before_params):
        assert torch.equal(a, b)
    for p, st in opt.state.items():
        if "acc" in st:
            assert torch.equal(st["acc"], before_acc[id(p)])
    # The caller skips the bad step; training goes on.
    opt.zero_grad()
    loss_fn(model, data[3]).backward()
    opt.step()
    assert opt.stats()["steps"] == 4
    opt.close()


@pytest.mark.parametrize("backend,check_at", [("torch", "step")] + (
    [("triton", "boundary")] if triton_available()[0] else []))
def test_nonfinite_gradient_at_a_reselection_raises_before_its_drain(backend, check_at):
    """A reselection brings the check's flags to the host in the copy of its picks, which it
    makes before changing anything: a NaN there raises before the drain applies the job in
    flight and before any column moves, and skipping the batch then equals a run that never
    saw it, bit for bit."""
    data = batches(9)
    cfg = dict(lr=3e-3, topk_ratio=0.25, update_interval=2, select_interval=4,
               min_offload_numel=64, backend=backend, check_finite_at=check_at)
    model, ref = make_model(), make_model()
    opt = ZenFlowOptimizer(list(model.named_parameters()), **cfg)
    ref_opt = ZenFlowOptimizer(list(ref.named_parameters()), **cfg)

    def step(m, o, x, poison=False):
        o.zero_grad()
        loss_fn(m, x).backward()
        if poison:
            m.fc1.weight.grad[1, 2] = float("nan")
        o.step()

    try:
        for x in data[:4]:  # step 4 launches a host job; step 5 reselects (drain first)
            step(model, opt, x)
            step(ref, ref_opt, x)
        before, counters = params_of(model), opt.stats()
        idx = {id(p): st["device_idx"].clone() for p, st in opt.state.items()
               if "device_idx" in st}
        with pytest.raises(NonFiniteGradientError,
                           match="'fc1.weight'.*no optimizer state was changed"):
            step(model, opt, data[4], poison=True)
        after = opt.stats()
        for k in ("steps", "selection_refreshes", "columns_migrated", "host_updates"):
            assert after[k] == counters[k], k
        for a, b in zip(params_of(model), before):  # the job in flight is not applied yet
            assert torch.equal(a, b)
        for p, st in opt.state.items():
            if "device_idx" in st:
                assert torch.equal(st["device_idx"], idx[id(p)])
        for x in data[5:9]:
            step(model, opt, x)
            step(ref, ref_opt, x)
        opt.synchronize()
        ref_opt.synchronize()
        assert opt.stats()["selection_refreshes"] == 2
        for a, b in zip(params_of(model), params_of(ref)):
            assert torch.equal(a, b)
    finally:
        opt.close()
        ref_opt.close()


def test_nonfinite_gradient_propagates_like_adamw_when_unchecked():
    model = make_model()
    opt = ZenFlowOptimizer(model.parameters(), topk_ratio=1.0, check_finite=False,
                           min_offload_numel=64)
    loss_fn(model, batches(1)[0]).backward()
    model.fc1.weight.grad[0, 0] = float("nan")
    opt.step()
    assert torch.isnan(model.fc1.weight[0, 0])
    opt.close()


def _steps(model, opt, n):
    for x in batches(n):
        opt.zero_grad()
        loss_fn(model, x).backward()
        opt.step()


def test_host_exception_surfaces_with_traceback(monkeypatch):
    model = make_model()
    opt = ZenFlowOptimizer(model.parameters(), topk_ratio=0.2, update_interval=2, overlap=True,
                           min_offload_numel=64)

    def boom(*a, **k):
        raise ArithmeticError("injected host failure")

    monkeypatch.setattr(host_adamw.HostAdamW, "_run_batch", boom)
    _steps(model, opt, 2)  # launches the failing job; overlap: not waited for yet
    t0 = time.monotonic()
    with pytest.raises(HostWorkerError, match="injected host failure") as info:
        opt.synchronize()
    assert time.monotonic() - t0 < 10
    assert "Traceback" in str(info.value) and "boom" in str(info.value)
    assert isinstance(info.value.__cause__, ArithmeticError)
    opt.close()


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.0, update_interval=1, overlap=False),  # streamed: fails inside a piece
    dict(topk_ratio=0.2, update_interval=2, overlap=True),   # staged: fails in the copy-in
], ids=["streamed", "staged"])
def test_failing_copy_surfaces_and_never_hangs(monkeypatch, cfg):
    from zenflow_triton.transfer import CopyIn, CopyQueue

    model = make_model()
    opt = ZenFlowOptimizer(model.parameters(), min_offload_numel=64, **cfg)

    def broken(self, *args):
        raise OSError("injected link failure")

    monkeypatch.setattr(CopyQueue, "copy", broken)  # the streamed job's pieces
    monkeypatch.setattr(CopyIn, "wait_on_host", broken)  # the staged job's copy-in
    t0 = time.monotonic()
    with pytest.raises(HostWorkerError, match="injected link failure"):
        _steps(model, opt, 2)
        opt.synchronize()
    assert time.monotonic() - t0 < 10
    opt.close()


def test_stuck_host_work_times_out(monkeypatch):
    model = make_model()
    opt = ZenFlowOptimizer(model.parameters(), topk_ratio=0.2, update_interval=1,
                           overlap=False, min_offload_numel=64, host_timeout=0.5)
    monkeypatch.setattr(host_adamw.HostAdamW, "_run_batch", lambda *a, **k: time.sleep(3))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="host_timeout=0.5"):
        _steps(model, opt, 1)
    assert time.monotonic() - t0 < 2.5
    monkeypatch.undo()
    opt.close()


def test_dead_worker_detected():
    model = make_model()
    opt = ZenFlowOptimizer(model.parameters(), topk_ratio=0.2, update_interval=1,
                           overlap=False, min_offload_numel=64, host_timeout=30)
    _steps(model, opt, 1)
    opt._worker._queue.put(None)  # the thread exits as if killed
    opt._worker._thread.join(5)
    t0 = time.monotonic()
    with pytest.raises(HostWorkerError, match="dead"):
        _steps(model, opt, 1)
    assert time.monotonic() - t0 < 5
    opt.close()


def test_huge_finite_gradients_are_not_refused():
    """The finite check reduces by sums of squares; a finite gradient that overflows one
    (elements near the fp32 maximum) must still step, as torch.optim.AdamW would."""
    from zenflow_triton import ZenFlowOptimizer

    from .support.helpers import assert_trajectories_close

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8))]
    ref = [torch.nn.Parameter(t.detach().clone()) for t in ours]
    opt = ZenFlowOptimizer(ours, lr=1e-3, topk_ratio=0.25, update_interval=1, overlap=False,
                           min_offload_numel=1)
    adamw = torch.optim.AdamW(ref, lr=1e-3, foreach=False)
    for scale in (3e19, -1e30, 1.0):  # squares overflow fp32 on the first two steps
        for ps in (ours, ref):
            ps[0].grad = torch.full((8, 16), scale)
            ps[1].grad = torch.full((8,), -scale)
        opt.step()
        adamw.step()
    assert opt.stats()["steps"] == 3
    assert_trajectories_close(ours, ref, 3, 1e-3)
    opt.close()
