"""State dicts kept in memory: what ``state_dict()`` hands out keeps the values of its call
while the optimizer trains on (host jobs in flight included), and ``load_state_dict`` copies,
so the source and the loaded optimizer never share storage. Resumes equal the uninterrupted
run bit for bit (tests/test_checkpoint.py does the same through a file)."""

from __future__ import annotations

import copy
import io
import threading
import time

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.host.adamw import HostAdamW

from .support.helpers import batches, make_model, param_groups, params_of, train, warmup_lambda

CFG = dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
           min_offload_numel=64, host_threads=3, chunk_size=101, fresh_if_spread=False)
SLOW_S = 0.15
"""How long each host AdamW job sleeps before it updates: a job launched by a step is
still in flight when the test does its next thing (a state dict, a load, a save)."""


@pytest.fixture
def slow_host(monkeypatch):
    original = HostAdamW.update_many

    def slowed(self, tasks):
        time.sleep(SLOW_S)
        return original(self, tasks)
    monkeypatch.setattr(HostAdamW, "update_many", slowed)


def fresh(model, **cfg):
    opt = ZenFlowOptimizer(param_groups(model), **{**CFG, **cfg})
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)


def uninterrupted(data, dtype, **cfg):
    model = make_model(dtype=dtype)
    opt, sched = fresh(model, **cfg)
    train(model, opt, data, sched)
    opt.synchronize()
    out = params_of(model)
    opt.close()
    return out


def assert_equal_params(model, want):
    for a, b in zip(params_of(model), want):
        assert torch.equal(a, b)


def assert_both_end_at(want, *runs):
    """Each ``(model, optimizer)`` of ``runs``, its host work done, holds ``want`` bit for
    bit; the optimizers are closed."""
    for m, o in runs:
        o.synchronize()
        assert_equal_params(m, want)
        o.close()


def tensors(sd_state: dict):
    """``(index, key, tensor)`` of every tensor of a state dict's per-param entries."""
    return [(i, k, v) for i, st in sd_state.items() if isinstance(st, dict)
            for k, v in st.items() if isinstance(v, torch.Tensor)]


def storages(states, written_only: bool = False) -> set[int]:
    """The storages of the tensors of param states; ``written_only``: of those a step writes
    in place (the column indices are replaced, never written)."""
    return {v.untyped_storage().data_ptr() for st in states if isinstance(st, dict)
            for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel()
            and not (written_only and k.endswith("_idx"))}


def resumed(saved_model, saved_opt, saved_sched, dtype, **cfg):
    """A new model and optimizer (another init: everything comes from the saved state)."""
    model = make_model(seed=123, dtype=dtype)
    model.load_state_dict(saved_model)
    opt, sched = fresh(model, **cfg)
    opt.load_state_dict(saved_opt)
    sched.load_state_dict(saved_sched)
    return model, opt, sched


@pytest.mark.parametrize("accumulate_on,dtype", [("device", torch.float32),
                                                 ("host", torch.bfloat16)])
def test_a_state_dict_held_while_the_source_trains_on_keeps_its_values(
        slow_host, accumulate_on, dtype):
    """The state dict is taken while a host job is in flight; the source then trains on (the
    device half writes its moments in place, the host accumulation adds into the
    accumulator, the next host job is in flight when the state dict is loaded): every tensor
    handed out still holds the values of the call, and the resume from it equals the
    uninterrupted run, as does the source."""
    data = batches(30)
    cfg = dict(accumulate_on=accumulate_on)
    want = uninterrupted(data, dtype, **cfg)

    model = make_model(dtype=dtype)
    opt, sched = fresh(model, **cfg)
    train(model, opt, data[:13], sched)  # the window that ended at step 12 is in flight
    assert opt.stats()["host_inflight"]
    sd = opt.state_dict()  # in memory, no file
    at_call = copy.deepcopy(sd)
    saved_model, saved_sched = copy.deepcopy(model.state_dict()), sched.state_dict()

    train(model, opt, data[13:21], sched)  # the window that ended at step 20 is in flight
    assert opt.stats()["host_inflight"]
    held = {(i, k): v for i, k, v in tensors(sd["state"])}
    for i, k, v in tensors(at_call["state"]):
        assert torch.equal(held[i, k], v), f"state {i} {k} changed after state_dict()"

    model2, opt2, sched2 = resumed(saved_model, sd, saved_sched, dtype, **cfg)
    train(model, opt, data[21:], sched)
    train(model2, opt2, data[13:], sched2)
    assert_both_end_at(want, (model, opt), (model2, opt2))


def test_a_state_dict_saved_by_a_background_thread_while_training_goes_on(slow_host):
    """An asynchronous checkpoint: a thread writes the state dict (torch.save) while the
    training loop goes on; its writes start only once the source has taken eight more steps
    and launched a host job. The saved file resumes to the uninterrupted run."""
    data = batches(30)
    want = uninterrupted(data, torch.float32)
    model = make_model()
    opt, sched = fresh(model)
    train(model, opt, data[:13], sched)
    stepped = threading.Event()

    class LateFile(io.BytesIO):
        def write(self, b):
            assert stepped.wait(60), "the training loop did not go on"
            return super().write(b)

    out = LateFile()
    payload = {"model": copy.deepcopy(model.state_dict()), "opt": opt.state_dict(),
               "sched": sched.state_dict()}
    saver = threading.Thread(target=torch.save, args=(payload, out))
    saver.start()
    del payload
    train(model, opt, data[13:21], sched)
    assert opt.stats()["host_inflight"]
    stepped.set()
    saver.join(60)
    assert not saver.is_alive()
    out.seek(0)
    saved = torch.load(out, weights_only=True)

    model2, opt2, sched2 = resumed(saved["model"], saved["opt"], saved["sched"], torch.float32)
    train(model2, opt2, data[13:], sched2)
    train(model, opt, data[21:], sched)
    assert_both_end_at(want, (model, opt), (model2, opt2))


@pytest.mark.parametrize("accumulate_on,dtype", [("device", torch.bfloat16),
                                                 ("host", torch.float32)])
def test_the_loaded_optimizer_shares_no_storage_with_the_source(accumulate_on, dtype):
    """Mid-window (an accumulator held) with a host job in flight: the loaded state's
    tensors share no storage with the source's state or the state dict, before and after both
    step on."""
    data = batches(16)
    cfg = dict(accumulate_on=accumulate_on)
    model = make_model(dtype=dtype)
    opt, sched = fresh(model, **cfg)
    train(model, opt, data[:14], sched)
    sd = opt.state_dict()
    model2, opt2, sched2 = resumed(copy.deepcopy(model.state_dict()), sd, sched.state_dict(),
                                   dtype, **cfg)
    assert any(st.get("acc") is not None for st in opt2.state.values())
    for _ in range(2):
        mine = storages(opt2.state.values())
        assert mine and not mine & storages(opt.state.values())
        assert not mine & storages(sd["state"].values())
        train(model, opt, data[14:], sched)
        train(model2, opt2, data[14:], sched2)
    opt.close()
    opt2.close()


def test_an_in_memory_resume_with_overlap_equals_the_uninterrupted_run(slow_host):
    """``opt2.load_state_dict(opt1.state_dict())`` while opt1's host job is in flight, then
    both train on, step for step beside each other: both equal the uninterrupted run, bit
    for bit, every time."""
    data = batches(22)
    cfg = dict(update_interval=2, select_interval=6)
    want = uninterrupted(data, torch.float32, **cfg)
    for cut in (5, 8, 11):  # in flight: the jobs of steps 4, 8 and 10
        model = make_model()
        opt, sched = fresh(model, **cfg)
        train(model, opt, data[:cut], sched)
        assert opt.stats()["host_inflight"]
        model2 = make_model(seed=123)
        model2.load_state_dict(model.state_dict())
        opt2, sched2 = fresh(model2, **cfg)
        opt2.load_state_dict(opt.state_dict())
        sched2.load_state_dict(sched.state_dict())
        for x in data[cut:]:
            train(model, opt, [x], sched)
            train(model2, opt2, [x], sched2)
        assert_both_end_at(want, (model, opt), (model2, opt2))


def test_state_is_copied_only_while_a_state_dict_is_held():
    """Saving costs no copy of the state: after ``torch.save(opt.state_dict(), f)`` the next
    step writes the same tensors; while a state dict is held, the next step writes copies
    (the held one keeps its storage and values)."""
    data = batches(16)
    model = make_model()
    opt, sched = fresh(model)
    train(model, opt, data[:13], sched)
    torch.save(opt.state_dict(), io.BytesIO())
    before = storages(opt.state.values())
    train(model, opt, data[13:14], sched)  # step 14: no reselection, no migration
    assert storages(opt.state.values()) == before

    sd = opt.state_dict()
    at_call = copy.deepcopy(sd)
    train(model, opt, data[14:15], sched)
    assert not (storages(opt.state.values(), written_only=True)
                & storages(sd["state"].values()))
    for (_, _, a), (_, _, b) in zip(tensors(sd["state"]), tensors(at_call["state"])):
        assert torch.equal(a, b)
    opt.close()
