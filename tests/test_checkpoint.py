"""Save / load / resume: a resumed run equals the uninterrupted one, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer

from .support.helpers import batches, clone_model, make_model, param_groups, params_of, train, warmup_lambda

# fresh_if_spread=False: these pin the schedule as given (with the random data's spread
# gradient the default would switch to apply_delay=1; test_spread.py resumes that one)
CFG = dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
           min_offload_numel=64, host_threads=2, chunk_size=101, fresh_if_spread=False)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # as HF Trainer loads optimizer state


def fresh(model, **cfg):
    opt = ZenFlowOptimizer(param_groups(model), **{**CFG, **cfg})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
    return opt, sched


def save_all(model, opt, sched):
    return roundtrip({"model": clone_model(model).state_dict(), "opt": opt.state_dict(),
                      "sched": sched.state_dict()})


def finish_and_compare(model, opt, sched, data, want):
    """Train ``model`` on ``data``, apply what is pending, and require ``want`` bit for bit."""
    train(model, opt, data, sched)
    opt.synchronize()
    for a, b in zip(params_of(model), want):
        assert torch.equal(a, b)
    opt.close()


def uninterrupted(data, dtype, **cfg):
    model = make_model(dtype=dtype)
    opt, sched = fresh(model, **cfg)
    train(model, opt, data, sched)
    opt.synchronize()
    out = params_of(model)  # (close() would go on to finish the open window)
    opt.close()
    return out


@pytest.mark.parametrize("accumulate_on,dtype,apply_delay,host_betas", [
    ("device", torch.float32, None, "step"), ("device", torch.bfloat16, None, "step"),
    ("host", torch.float32, None, "step"), ("host", torch.bfloat16, None, "step"),
    # the result of the window that ended at step 12 is applied at step 15, after the resume
    ("device", torch.float32, 3, "step"), ("host", torch.bfloat16, 3, "step"),
    # host_step counts gradients, and the saved state carries it
    ("device", torch.float32, None, "window")])
def test_resume_mid_window_equals_uninterrupted(accumulate_on, dtype, apply_delay, host_betas):
    data = batches(30)
    cfg = dict(accumulate_on=accumulate_on, apply_delay=apply_delay, host_betas=host_betas)
    want = uninterrupted(data, dtype, **cfg)

    model = make_model(dtype=dtype)
    opt, sched = fresh(model, **cfg)
    train(model, opt, data[:13], sched)  # the window that ended at step 12 is in flight
    assert opt.stats()["host_inflight"]
    saved = save_all(model, opt, sched)
    assert not opt.stats()["host_inflight"]  # state_dict() waited for it ...
    # ... and saved its result as pending, not applied: the params still hold the old values.
    pending = [s["host_pending"] for s in saved["opt"]["state"].values() if s["kind"] == "matrix"]
    assert pending and all(pending)
    # The uninterrupted run continues from the same object: saving changed nothing.
    finish_and_compare(model, opt, sched, data[13:], want)

    model2 = make_model(seed=123, dtype=dtype)  # different init: everything must come from the save
    model2.load_state_dict(saved["model"])
    opt2, sched2 = fresh(model2, **cfg)
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    finish_and_compare(model2, opt2, sched2, data[13:], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rolling_back_the_same_optimizer_with_work_in_flight(dtype):
    """load_state_dict into the optimizer that saved it, while a later host job is in flight
    (a rollback, as after a loss spike): nothing of that later job may leak into the params."""
    data = batches(30)
    want = uninterrupted(data, dtype)

    model = make_model(dtype=dtype)
    opt, sched = fresh(model)
    train(model, opt, data[:13], sched)
    saved = save_all(model, opt, sched)
    train(model, opt, data[13:21], sched)  # a later window's job is in flight now
    assert opt.stats()["host_inflight"]
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    finish_and_compare(model, opt, sched, data[13:], want)


def test_state_dict_shows_the_split_and_keeps_index_dtypes():
    model = make_model()
    opt, _ = fresh(model)
    train(model, opt, batches(5))
    sd = roundtrip(opt.state_dict())
    mats = [s for s in sd["state"].values() if s["kind"] == "matrix"]
    smalls = [s for s in sd["state"].values() if s["kind"] == "small"]
    assert mats and smalls
    for s in mats:
        rows = s["host_m"].shape[0]
        assert s["device_idx"].dtype == torch.long and s["host_idx"].dtype == torch.long
        assert s["device_m"].shape == (rows, s["device_idx"].numel())
        assert s["host_m"].shape == (rows, s["host_idx"].numel())
        both = torch.cat([s["device_idx"], s["host_idx"]]).sort().values
        assert torch.equal(both, torch.arange(both.numel()))
    assert sd["zenflow"]["global_step"] == 5
    # A framework that casts every state tensor to the param dtype (torch's default
    # Optimizer.load_state_dict does) must not break index tensors.
    for s in sd["state"].values():
        for k, v in list(s.items()):
            if isinstance(v, torch.Tensor):
                s[k] = v.to(torch.float64)
    opt2, _ = fresh(make_model())
    opt2.load_state_dict(sd)
    for s in opt2.state.values():
        if s["kind"] == "matrix":
            assert s["device_idx"].dtype == torch.long and s["host_idx"].dtype == torch.long
            assert s["host_m"].dtype == torch.float32
    opt.close()
    opt2.close()


def test_roundtrip_before_first_step():
    """Accelerate saves and loads at prepare(), before any step."""
    data = batches(10)
    model = make_model()
    opt, _ = fresh(model)
    sd = roundtrip(opt.state_dict())
    assert sd["state"] == {}
    opt.load_state_dict(sd)
    train(model, opt, data)
    opt.synchronize()
    got = params_of(model)
    model2 = make_model()
    opt2, _ = fresh(model2)
    train(model2, opt2, data)
    opt2.synchronize()
    for a, b in zip(got, params_of(model2)):
        assert torch.equal(a, b)
    opt.close()
    opt2.close()


def test_load_rejects_mismatched_groups():
    model = make_model()
    opt, _ = fresh(model)
    sd = opt.state_dict()
    sd["param_groups"] = sd["param_groups"][:1]
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(sd)
    opt.close()


def test_the_open_windows_lr_sum_is_checked_and_taken_back_as_a_float():
    """``acc_lr`` (the sum of the open window's lrs, since 2026-12-06): a tensor, as a
    framework may hand it back, loads as a float and resumes bit for bit; a bad value is
    refused naming it, the optimizer's state untouched; a state saved before the sum
    existed still loads."""
    data = batches(6)
    model = make_model()

    def constant_lr(m):  # (fresh()'s schedule starts at lr 0: no sum to see)
        return ZenFlowOptimizer(param_groups(m), **CFG)

    opt = constant_lr(model)
    train(model, opt, data[:2])  # mid-window: the window of 4 holds 2 gradients
    sd = roundtrip(opt.state_dict())
    sums = [st["acc_lr"] for st in sd["state"].values() if "acc_lr" in st]
    assert sums and any(x > 0 for x in sums)
    as_tensors = roundtrip(sd)
    for st in as_tensors["state"].values():
        if "acc_lr" in st:
            st["acc_lr"] = torch.tensor(st["acc_lr"], dtype=torch.float64)
    model2 = make_model()
    opt2 = constant_lr(model2)
    bad = roundtrip(sd)
    next(st for st in bad["state"].values() if "acc_lr" in st)["acc_lr"] = float("nan")
    with pytest.raises(ValueError, match="acc_lr must be a finite number"):
        opt2.load_state_dict(bad)
    assert opt2.state_dict()["state"] == {}
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(as_tensors)
    assert all(isinstance(st.get("acc_lr", 0.0), float) for st in opt2.state.values())
    train(model, opt, data[2:])
    train(model2, opt2, data[2:])
    opt.synchronize()
    opt2.synchronize()
    for a, b in zip(params_of(model), params_of(model2)):
        assert torch.equal(a, b)
    old = roundtrip(sd)
    for st in old["state"].values():
        st.pop("acc_lr", None)
    model3 = make_model()
    opt3 = constant_lr(model3)
    opt3.load_state_dict(old)
    for o in (opt, opt2, opt3):
        o.close()


def test_load_warns_when_the_saved_schedule_or_step_rule_differs():
    """A state saved under host_lr_scale=1.0 (the default before "sqrt") and loaded into an
    optimizer with today's default warns, naming the field; execution-only fields (threads,
    chunk size) and an unchanged config do not."""
    import warnings

    model = make_model()
    old = ZenFlowOptimizer(param_groups(model), lr=1e-3, host_lr_scale=1.0, chunk_size=4096,
                           host_threads=1)
    sd = roundtrip(old.state_dict())
    old.close()
    new = ZenFlowOptimizer(param_groups(model), lr=1e-3)
    with pytest.warns(UserWarning, match=r"host_lr_scale: 1\.0 -> 'adaptive'") as rec:
        new.load_state_dict(sd)
    assert len(rec) == 1 and "chunk_size" not in str(rec[0].message)
    new.close()
    same = ZenFlowOptimizer(param_groups(model), lr=1e-3, host_lr_scale=1.0, chunk_size=2048,
                            host_threads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(sd)
    same.close()


def test_save_sharded_in_one_process_round_trips(tmp_path):
    """save_sharded/load_sharded (torch.distributed.checkpoint) without torch.distributed:
    a world of one, mid-window with host work pending; resuming equals the uninterrupted run
    bit for bit. (Several ranks: tests/test_distributed.py.)"""
    from zenflow_triton import ZenFlowOptimizer

    from .support.helpers import batches, loss_fn, make_model, train

    data = batches(12)
    cfg = dict(topk_ratio=0.2, update_interval=4, select_interval=8, min_offload_numel=64,
               host_state_dtype="bfloat16")

    def run(resume: bool):
        model = make_model()
        opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **cfg)
        if resume:
            train(model, opt, data[:6])
            opt.save_sharded(tmp_path / "ck")
            opt.close(finish=False)  # handed over: the new optimizer goes on from here
            opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **cfg)
            opt.load_sharded(tmp_path / "ck")
            assert {st["host_m"].dtype for st in opt.state.values() if "host_m" in st} \
                == {torch.bfloat16}
            train(model, opt, data[6:])
        else:
            train(model, opt, data)
        opt.synchronize()
        opt.close()
        return [p.detach().clone() for p in model.parameters()]

    for x, y in zip(run(True), run(False)):
        assert torch.equal(x, y)


def test_a_state_dict_saved_by_an_earlier_version_loads():
    """tests/data/state_dict_fc55536.pt was saved by the code of commit fc55536 (before the
    state-dict module, the checks on load and telemetry leaving the state dict) mid-window,
    with a host result pending: it loads, and the 6 steps after it reproduce that code's
    run (to fp32 rounding: the file was written on another CPU)."""
    from pathlib import Path

    from .support.helpers import assert_trajectories_close, batches, params_of, train

    saved = torch.load(Path(__file__).parent / "data" / "state_dict_fc55536.pt",
                       weights_only=True)
    model = make_model()
    model.load_state_dict(saved["model"])
    # that code's default step rule ("sqrt"; "adaptive" since 2026-12-05)
    opt = ZenFlowOptimizer(param_groups(model), topk_ratio=0.2, update_interval=4,
                           select_interval=8, min_offload_numel=64, host_lr_scale="sqrt")
    opt.load_state_dict(saved["opt"])
    assert opt.stats()["steps"] == 14
    assert any(st.get("host_pending") for st in opt.state.values())
    train(model, opt, batches(20)[14:20])
    opt.synchronize()
    opt.close()
    assert_trajectories_close(params_of(model), saved["after"], 20, 3e-3 * 2)


def test_state_dict_gathers_host_halves_in_bounded_batches(monkeypatch):
    """``state_format.gather_host_halves`` gathers at most GATHER_BYTES of rows a call (one
    tensor larger than that alone), so the collective's device never holds every host half
    at once; the gathered state dict is the one an unbatched gather gives."""
    from zenflow_triton.checkpoint import state_dict as state_format

    class RecordingShard:  # one process's gather (rows as they are), sizes recorded
        device = torch.device("cpu")

        def __init__(self):
            self.calls = []

        def gather_rows(self, parts, totals, **_):
            self.calls.append(sum(p.numel() * p.element_size() for p in parts))
            return [p.clone() for p in parts]

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    with ZenFlowOptimizer(model.parameters(), topk_ratio=0.25, min_offload_numel=64) as opt:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        sd = opt.state_dict()
    params = list(model.parameters())
    want = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            for i, st in sd["state"].items()}
    one_half = 32 * 24 * 4  # a host master: 32 rows x 24 host columns, fp32
    monkeypatch.setattr(state_format, "GATHER_BYTES", 2 * one_half)
    shard = RecordingShard()
    state_format.gather_host_halves(sd["state"], params, shard)
    n_halves = sum(isinstance(st.get(k), torch.Tensor) for st in sd["state"].values()
                   for k in state_format.ROW_SHARDED)
    assert len(shard.calls) >= n_halves // 2 > 1, shard.calls
    assert max(shard.calls) <= 2 * one_half, shard.calls
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, want[i][k]), (i, k)
