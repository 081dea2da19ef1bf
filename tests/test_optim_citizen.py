"""ZenFlowOptimizer as a torch.optim citizen under faults: loads that do not fit, failures
of host work, hooks, names, deterministic state dicts, torch's conventions, AdamW state
dicts both ways, strided layouts, interrupted steps."""

from __future__ import annotations

import copy

import pytest
import torch

from zenflow_triton import OptimizerFailedError, ZenFlowOptimizer
from zenflow_triton.host import adamw as host_adamw
from zenflow_triton.host.worker import HostWorker

from .support.helpers import (assert_trajectories_close, batches, loss_fn, make_model,
                              param_groups, params_of, train, tree_env)

CFG = dict(topk_ratio=0.2, update_interval=2, select_interval=4, min_offload_numel=64)


def make(model, **kw):
    return ZenFlowOptimizer(param_groups(model), **{**CFG, **kw})


def same(a, b) -> bool:
    """Deep equality of state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def matrix_index(sd) -> int:
    return next(i for i, st in sd["state"].items() if st.get("kind") == "matrix")


# ---------------------------------------------------------------- 0: loads that do not fit
@pytest.mark.parametrize("damage", ["wider host half", "index out of range", "float index",
                                    "unsorted index", "halves overlap", "small shape",
                                    "master on fp32", "missing key"])
def test_a_state_that_does_not_fit_is_refused_before_anything_changes(damage):
    model = make_model()
    opt = make(model)
    train(model, opt, batches(3))
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    i = matrix_index(bad)
    st = bad["state"][i]
    if damage == "wider host half":
        st["host_m"] = torch.zeros(st["host_m"].shape[0], st["host_m"].shape[1] + 6)
    elif damage == "index out of range":
        st["host_idx"] = st["host_idx"].clone()
        st["host_idx"][-1] = 10_000
    elif damage == "float index":
        st["host_idx"] = st["host_idx"].double() + 0.5
    elif damage == "unsorted index":
        st["host_idx"] = st["host_idx"].flip(0)
    elif damage == "halves overlap":
        st["device_idx"] = st["host_idx"][: st["device_idx"].numel()].clone()
    elif damage == "small shape":
        j = next(k for k, s in bad["state"].items() if s.get("kind") == "small")
        bad["state"][j]["exp_avg"] = torch.zeros(3)
    elif damage == "master on fp32":
        st["device_master"] = torch.zeros_like(st["device_m"])
    elif damage == "missing key":
        del st["host_v"]
    with pytest.raises(ValueError, match="state for"):
        opt.load_state_dict(bad)
    assert same(opt.state_dict(), good)  # nothing changed
    train(model, opt, batches(2, seed=5))  # and it goes on
    opt.close()


def test_float_indices_from_a_framework_cast_still_load():
    """torch's default load casts every state tensor to the param's dtype: integral float
    indices are accepted and come back int64."""
    model = make_model()
    opt = make(model)
    train(model, opt, batches(3))
    sd = opt.state_dict()
    cast = copy.deepcopy(sd)
    for st in cast["state"].values():
        for k in ("device_idx", "host_idx"):
            if k in st:
                st[k] = st[k].float()
    other = make(make_model())
    other.load_state_dict(cast)
    assert same(other.state_dict()["state"], sd["state"])
    opt.close()
    other.close()


# ---------------------------------------------------------------- 1: failure of host work
def test_after_a_host_failure_every_later_call_raises_until_a_good_load(monkeypatch):
    model = make_model()
    opt = make(model)
    data = batches(8)
    train(model, opt, data[:4])
    checkpoint = copy.deepcopy(opt.state_dict())  # as torch.save: the live tensors move on
    weights = copy.deepcopy(model.state_dict())

    real = host_adamw.HostAdamW._run_batch

    def boom(*a, **k):
        raise ArithmeticError("injected host failure")

    monkeypatch.setattr(host_adamw.HostAdamW, "_run_batch", boom)
    with pytest.raises(Exception, match="injected host failure"):
        train(model, opt, data[4:8])  # the failure surfaces at the next apply
    monkeypatch.setattr(host_adamw.HostAdamW, "_run_batch", real)
    for call in (lambda: train(model, opt, data[4:5]), opt.state_dict, opt.synchronize):
        with pytest.raises(OptimizerFailedError, match="load_state_dict") as info:
            call()
        assert "injected host failure" in str(info.value.__cause__)
    # a good checkpoint heals it: the run from there equals the uninterrupted one
    model.load_state_dict(weights)
    opt.load_state_dict(checkpoint)
    train(model, opt, data[4:8])
    opt.synchronize()
    ref_model = make_model()
    ref = make(ref_model)
    train(ref_model, ref, data)
    ref.synchronize()
    for a, b in zip(params_of(model), params_of(ref_model)):
        assert torch.equal(a, b)
    opt.close()
    ref.close()


# ---------------------------------------------------------------- 2-4: hooks, names, bits
def test_hooks_run_in_torch_order_and_any_state_value_is_kept():
    model = make_model()
    opt = make(model)
    train(model, opt, batches(2))
    calls = []

    def sd_pre(o):
        calls.append("sd_pre")
        o.state["test"] = 1  # torch's own hook test puts a non-dict value there

    def sd_post(o, sd):
        calls.append("sd_post")
        assert "zenflow" in sd and sd["state"]["test"] == 1
        sd["state"].pop("test")
        sd["ran"] = True
        return sd

    def load_pre(o, sd):
        calls.append("load_pre")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.002) for g in sd["param_groups"]]
        return sd

    def load_post(o):
        calls.append("load_post")
        o.state["ran_load_post"] = o.param_groups[0]["lr"] == 0.002

    opt.register_state_dict_pre_hook(sd_pre)
    opt.register_state_dict_post_hook(sd_post)
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(load_post)
    sd = opt.state_dict()
    assert sd["ran"] is True and "test" not in sd["state"]
    opt.load_state_dict(sd)
    assert calls == ["sd_pre", "sd_post", "load_pre", "load_post"]
    assert opt.state["ran_load_post"] is True
    opt.stats()  # non-param state entries do not trip the accounting
    train(model, opt, batches(2, seed=3))
    opt.close()


def test_names_saved_are_kept_by_an_optimizer_built_without_them():
    model = make_model()
    named = ZenFlowOptimizer(list(model.named_parameters()), **CFG)
    train(model, named, batches(2))
    sd = named.state_dict()
    assert sd["param_groups"][0]["param_names"][0] == "emb.weight"
    plain = ZenFlowOptimizer(model.parameters(), **CFG)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["param_names"] == sd["param_groups"][0]["param_names"]
    named.close()
    plain.close()


def test_identical_runs_give_identical_state_dicts():
    def run():
        model = make_model()
        opt = make(model)
        train(model, opt, batches(7))
        sd = opt.state_dict()
        opt.close()
        return sd

    a, b = run(), run()
    assert same(a, b)
    assert "counters" not in a["zenflow"]


# ---------------------------------------------------------------- 5: conventions
def test_tensor_lr_raises_value_error_as_torch_does():
    model = make_model()
    with pytest.raises(ValueError, match="lr as a Tensor"):
        ZenFlowOptimizer(model.parameters(), lr=torch.tensor(1e-3))
    opt = ZenFlowOptimizer(model.parameters(), **CFG)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)  # as a scheduler could
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(ValueError, match="lr as a Tensor"):
        opt.step()
    assert opt.stats()["steps"] == 0
    opt.close()


# (capturable, differentiable, foreach and fused choose a kernel, not the update: accepted
# and dropped, tests/test_finish.py)
@pytest.mark.parametrize("key,value", [("maximize", True), ("amsgrad", True)])
def test_unsupported_adamw_options_raise_naming_the_key(key, value):
    model = make_model()
    with pytest.raises(ValueError, match=key):
        ZenFlowOptimizer([{"params": model.parameters(), key: value}])
    opt = ZenFlowOptimizer([model.fc1.weight], **CFG)
    with pytest.raises(ValueError, match=key):
        opt.add_param_group({"params": [model.fc2.weight], key: value})
    adamw = torch.optim.AdamW([model.fc1.weight], maximize=(key == "maximize"),
                              amsgrad=(key == "amsgrad"))
    if key in ("maximize", "amsgrad"):  # an AdamW state dict that relies on it
        with pytest.raises(ValueError, match=key):
            opt.load_state_dict(adamw.state_dict())
    opt.close()


def _adamw_run(model, data, sd=None, lr=3e-3):
    opt = torch.optim.AdamW(param_groups(model, lr=lr), foreach=False)
    if sd is not None:
        opt.load_state_dict(sd)
    train(model, opt, data)
    return opt


def test_switch_from_adamw_mid_training_and_back():
    data = batches(12)
    ref_model = make_model()
    _adamw_run(ref_model, data)
    want = params_of(ref_model)

    # AdamW for 6 steps, then ZenFlow (topk_ratio=1.0) for 6: AdamW's trajectory
    model = make_model()
    first = _adamw_run(model, data[:6])
    opt = ZenFlowOptimizer(param_groups(model), topk_ratio=1.0, update_interval=4,
                           min_offload_numel=64)
    opt.load_state_dict(first.state_dict())
    train(model, opt, data[6:])
    assert_trajectories_close(params_of(model), want, 12, 3e-3)
    opt.close()

    # and a split run: AdamW 6 steps, ZenFlow update_interval=1 (device and host halves)
    # for 4, back to AdamW for 2: AdamW's trajectory
    model = make_model()
    first = _adamw_run(model, data[:6])
    opt = ZenFlowOptimizer(param_groups(model), topk_ratio=0.3, update_interval=1,
                           overlap=False, select_interval=2, min_offload_numel=64)
    opt.load_state_dict(first.state_dict())
    train(model, opt, data[6:10])
    back = opt.to_adamw_state_dict()
    opt.close()
    _adamw_run(model, data[10:], sd=back)
    assert_trajectories_close(params_of(model), want, 12, 3e-3)


def test_to_adamw_refuses_an_open_window():
    model = make_model()
    opt = make(model, update_interval=4)
    train(model, opt, batches(5))  # step 5: one gradient in the window
    with pytest.raises(ValueError, match="window is open"):
        opt.to_adamw_state_dict()
    opt.close()


# ---------------------------------------------------------------- 6: strided layouts
class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(16, 32, 3)   # 4608 elements: split with the defaults
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def _conv_run(opt_fn, layout, steps=10):
    net = ConvNet().to(memory_format=layout)
    opt = opt_fn(net)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(4, 16, 6, 6, generator=g).to(memory_format=layout)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
        opt.close()
    return net


def test_channels_last_conv_weights_train():
    cl = torch.channels_last
    assert ConvNet().to(memory_format=cl).conv.weight.numel() >= 4096
    want = _conv_run(lambda n: torch.optim.AdamW(n.parameters(), lr=1e-2, foreach=False), cl)
    got = _conv_run(lambda n: ZenFlowOptimizer(n.parameters(), lr=1e-2, topk_ratio=0.25,
                                               update_interval=1, overlap=False,
                                               select_interval=3), cl)
    assert got.conv.weight.is_contiguous(memory_format=cl)
    assert_trajectories_close(params_of(got), params_of(want), 10, 1e-2)
    # the defaults too (a real window): the split follows the memory order, and the run is
    # the same as with a contiguous weight up to the order of the columns
    a = _conv_run(lambda n: ZenFlowOptimizer(n.parameters(), lr=1e-2), cl)
    b = _conv_run(lambda n: ZenFlowOptimizer(n.parameters(), lr=1e-2),
                  torch.contiguous_format)
    assert torch.isfinite(a.conv.weight).all()
    assert (a.conv.weight - ConvNet().conv.weight).abs().max() > 1e-3  # it trained
    assert (a.conv.weight - b.conv.weight).abs().max() < 0.05


def test_a_layout_whose_rows_are_not_outermost_is_refused_by_name():
    w = torch.nn.Parameter(torch.randn(64, 8, 16).transpose(0, 1))  # rows are dim 0 = 8
    with pytest.raises(ValueError, match="strides"):
        ZenFlowOptimizer([w], min_offload_numel=64)


# ---------------------------------------------------------------- 7: interrupted steps
# overlap: the schedule as given (a boundary that applies the window before it); the random
# data's spread gradient would otherwise switch it to apply_delay=1 (fresh_if_spread)
@pytest.mark.parametrize("cfg", [dict(overlap=True, fresh_if_spread=False),
                                 dict(overlap=False)], ids=["overlap", "sync"])
def test_a_step_interrupted_at_any_wait_is_before_or_after_never_between(cfg, monkeypatch):
    """Interrupt each wait of a boundary step once: the optimizer is then exactly where the
    run before the step, or the run after it, is (state dict and params, bit for bit)."""
    data = batches(6)

    def state_after(n):
        model = make_model()
        opt = make(model, **cfg)
        train(model, opt, data[:n])
        out = (opt.state_dict(), params_of(model))
        opt.close()
        return out

    before, after = state_after(3), state_after(4)
    real = HostWorker.wait_event
    waits = 0
    k = 0
    while True:
        model = make_model()
        opt = make(model, **cfg)
        train(model, opt, data[:3])
        calls = {"n": 0}

        def wait_event(self, event, label, _k=k):
            calls["n"] += 1
            if calls["n"] == _k + 1:
                raise KeyboardInterrupt
            return real(self, event, label)

        monkeypatch.setattr(HostWorker, "wait_event", wait_event)
        opt.zero_grad()
        loss_fn(model, data[3]).backward()
        try:
            opt.step()
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        monkeypatch.setattr(HostWorker, "wait_event", real)
        if not interrupted:
            waits = k
            opt.close()
            break
        here = (opt.state_dict(), params_of(model))
        assert same(here, before) or same(here, after), f"interrupt at wait {k}: in between"
        if same(here, before):  # retrying the batch is then right: it equals the run
            opt.zero_grad()
            loss_fn(model, data[3]).backward()
            opt.step()
            assert same((opt.state_dict(), params_of(model)), after)
        opt.close()
        k += 1
    assert waits >= 1  # the boundary step did wait somewhere


def test_an_exception_from_a_step_hook_leaves_the_step_undone_or_done():
    model = make_model()
    opt = make(model)
    train(model, opt, batches(2))
    sd = opt.state_dict()

    def bad_pre(o, args, kwargs):
        raise RuntimeError("pre-hook")

    h = opt.register_step_pre_hook(bad_pre)
    loss_fn(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="pre-hook"):
        opt.step()
    assert same(opt.state_dict(), sd)
    h.remove()
    opt.close()


# ---------------------------------------------------------------- generic torch.optim behaviour
def test_generic_optimizer_behaviour():
    """What torch's generic optimizer tests check that applies here: a state dict round trip
    before the first step, the closure, param groups added late, zero_grad, schedulers."""
    model = make_model()
    opt = ZenFlowOptimizer([model.fc1.weight, model.fc1.bias], lr=1e-2, **CFG)
    fresh = opt.state_dict()  # before any step (Accelerate's prepare)
    opt.load_state_dict(fresh)
    x = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor)
    opt.add_param_group({"params": [model.fc2.weight], "lr": 5e-3})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    w0 = model.fc2.weight.detach().clone()
    for _ in range(4):
        opt.step(closure)
        sched.step()
    assert not torch.equal(w0, model.fc2.weight)  # the late group trains
    assert opt.param_groups[1]["lr"] == pytest.approx(5e-3 * 0.5 ** 4)
    opt.zero_grad()
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])
    again = ZenFlowOptimizer([model.fc1.weight, model.fc1.bias], lr=1e-2, **CFG)
    again.add_param_group({"params": [model.fc2.weight], "lr": 5e-3})
    again.load_state_dict(opt.state_dict())
    assert same(again.state_dict(), opt.state_dict())
    opt.close()
    again.close()


def test_the_optimizer_needs_no_optuna_and_the_tuner_says_how_to_get_it():
    import subprocess
    import sys
    code = """
import sys
sys.modules["optuna"] = None  # as if not installed
import torch
from zenflow_triton import ZenFlowOptimizer
m = torch.nn.Linear(128, 64)
opt = ZenFlowOptimizer.from_profile("a100-pcie4", m.parameters(), lr=1e-3)
m(torch.randn(2, 128)).sum().backward()
opt.step()
opt.close()
from autotune import cli
sys.exit(cli.main(["run", "--quick"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=tree_env())
    assert out.returncode == 1, out.stderr
    assert "zenflow-triton[tune]" in out.stderr
