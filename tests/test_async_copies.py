"""Copies that land later: gradient streaming and the host pipeline over a link whose
non-blocking copies complete on another thread, only once someone waits for them
(``tests/support/async_link.py``), so a reader that skips its wait reads NaN.

* Streaming (one and several micro-batches, clipping, warm-up, reselections, a load between
  backward and step, no overlap) and the host pipeline's copy-in and host accumulation train
  bit for bit as over the plain CPU link, where every copy is made at once.
* ``zero_grad()`` leaves no copy of the dropped gradients in flight.
* Back-pressure: with the link slower than backward, the device memory held by copies in
  flight never exceeds the stream's bound (the largest matrix's gradient), where
  without it a whole backward's gradients would pile up.
"""

from __future__ import annotations

import copy

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.guards.inputs import NonFiniteGradientError

from .support.async_link import install
from .test_streaming import BASE, assert_same, batches, mlp


def train(late: bool, steps: int = 12, micro: int = 1, load_at: int | None = None,
          latency: float = 0.0, **cfg):
    """``steps`` steps of ``micro`` micro-batches over the plain link, or (``late``) over
    the fake one (``latency``: seconds a copy takes once waited for); ``load_at``: before
    that step's ``step()``, the optimizer's own state saved at the step before is loaded
    back (a load between backward and step)."""
    model = mlp()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **dict(BASE, **cfg))
    fake = install(opt, latency) if late else None
    data = batches(model)
    saved = None
    try:
        for t in range(steps):
            for _ in range(micro):
                next(data)(model).backward()
            if load_at is not None and t == load_at - 1:  # a checkpoint as written out (an
                saved = copy.deepcopy(opt.state_dict())  # in-memory one aliases the state)
            if t == load_at:
                opt.load_state_dict(saved)
            opt.step()
            opt.zero_grad()
        opt.finish()
    finally:
        opt.close()
        if fake is not None:
            waited = fake.waits
            fake.close()
    if late:
        assert waited, "nothing waited for a copy: the fake link was not used"
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cfg", [
    dict(), dict(micro=2), dict(micro=3, max_grad_norm=0.05), dict(micro=2, warmup_steps=3),
    dict(micro=2, check_finite=False, latency=0.005),
    dict(micro=2, check_finite=False, max_grad_norm=0.05, latency=0.005),
    dict(update_interval=2, select_interval=4, micro=2),
    dict(overlap=False, micro=2)],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
def test_streaming_over_a_late_link_trains_as_over_a_plain_one(cfg):
    # check_finite=False: nothing waits for a micro-batch's sum before the step's finalize
    # job on the host worker, or before the clipping norm of the summed gradient (the
    # adder's job, slowed down by the latency, races them).
    latency = cfg.pop("latency", 0.0)
    assert_same(train(False, stream_grads=True, **cfg),
                train(True, stream_grads=True, latency=latency, **cfg),
                f"streaming over a late link with {cfg}")


@pytest.mark.parametrize("load_at", [5, 8], ids=["split", "before a reselection"])
def test_a_load_between_backward_and_step_over_a_late_link(load_at):
    # One micro-batch: only the load itself (or the step after it) waits for the copies.
    cfg = dict(stream_grads=True, load_at=load_at)
    assert_same(train(False, **cfg), train(True, **cfg), f"a load before step {load_at}")


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_the_host_pipeline_over_a_late_link(accumulate_on):
    # "device": each window's copy-in (the job waits for its event before it reads the
    # staged gradient); "host": each step's host accumulation (the worker waits for the
    # copy before it adds it).
    cfg = dict(accumulate_on=accumulate_on, update_interval=2, select_interval=4)
    assert_same(train(False, **cfg), train(True, **cfg), f"accumulate_on={accumulate_on}")


def test_zero_grad_leaves_no_copy_of_the_dropped_gradients_in_flight():
    model = mlp()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    fake = install(opt)
    data = batches(model)
    try:
        for t in range(6):
            if t in (0, 4):  # a whole gradient (the first step), a split one
                fake.drain()  # the last step's copies: the host worker's to wait for
            next(data)(model).backward()  # one micro-batch: no adder job waits for them
            if t in (0, 4):
                opt.zero_grad()
                assert fake.pending == 0, f"step {t}: dropped while still being copied"
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
        fake.close()


def test_backward_waits_for_a_slow_link_to_bound_the_copies_in_flight():
    # 8 equal matrices; the fake link lands a copy only once someone waits for it (slower
    # than any backward). Without back-pressure every gradient of a backward would be in
    # flight at once (the whole model's on a selecting step); with it, never more than the
    # bound: one matrix's gradient (with the one in hand, twice that: what fit counts).
    torch.manual_seed(0)
    n, width = 8, 128
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)])
    one = width * width * 4
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, topk_ratio=0.1,
                           update_interval=2, select_interval=4, stream_grads=True)
    fake = install(opt)
    peaks = []
    try:
        for _ in range(6):
            for _ in range(2):  # micro-batches: the second's copies join the first's
                fake.reset_peak()
                model(torch.randn(4, width)).square().mean().backward()
                peaks.append(fake.peak_in_flight_bytes)
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
        fake.close()
    bound = opt._stream.copy_bound
    assert bound == one
    assert max(peaks) <= bound, (peaks, bound)
    assert max(peaks) == bound  # a whole gradient in flight while backward goes on


def test_an_overflowing_sum_is_caught_over_a_late_link():
    # Each micro-batch finite, their host sum inf (every column host-owned: no device sum
    # to flag it): the step's check must wait for the sum's own verdict (the adder's, after
    # the copies land, a while later here) before it changes anything.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True,
                           **dict(BASE, topk_ratio=0.0))
    fake = install(opt, latency=0.2)
    try:
        for t in range(2):
            for _ in range(2):  # fp32 max 3.4e38
                model(torch.ones(1, 32)).sum().mul(2e38 if t else 1.0).backward()
            if t:
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
            else:
                opt.step()  # the first step selects: the next one splits
            opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.close()
        fake.close()
