"""``check_finite_at="boundary"``: the NaN/inf check read only where the host waits anyway.

A bad gradient at a steady step masks the device half from that step on (the kernels read a
device flag) and the next boundary raises, naming the step, with the masked steps undone:
the state is then exactly the state after the step before the bad one, and training that
goes on from there equals a run that never saw the bad batches, bit for bit. Run on the
Triton backend (the interpreter on CPU), whose kernels read the flag.
"""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ConfigError, NonFiniteGradientError, ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

from .support.helpers import batches, loss_fn, make_model, params_of

pytestmark = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])
# Compiled kernels on a GPU (bench/gpu_check.sh), the interpreter on CPU tensors elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Windows of 4, reselection every 8: steps 1 and 9 reselect, 4 and 8 are boundaries, the
# others are steady (their check deferred).
CFG = dict(topk_ratio=0.25, update_interval=4, select_interval=8, min_offload_numel=64,
           backend="triton", check_finite_at="boundary")


def _model():
    return make_model().to(DEVICE)


def _opt(model):
    return ZenFlowOptimizer(list(model.named_parameters()), lr=3e-3, **CFG)


def _grads(model, x, poison: bool = False) -> None:
    model.zero_grad()
    loss_fn(model, x.to(DEVICE)).backward()
    if poison:
        model.fc1.weight.grad[1, 2] = float("nan")


def _train(model, opt, data) -> None:
    for x in data:
        _grads(model, x)
        opt.step()


def _lockstep(runs, data) -> None:
    """Each (model, optimizer) of ``runs`` steps on each batch of ``data``, in turn."""
    for x in data:
        for m, o in runs:
            _grads(m, x)
            o.step()


def _assert_same_params(model, opt, ref, ref_opt) -> None:
    """Both runs' host work applied, their params equal bit for bit."""
    opt.synchronize()
    ref_opt.synchronize()
    for a, b in zip(params_of(model), params_of(ref)):
        assert torch.equal(a, b)


def _device_state(opt) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq", "device_m", "device_v", "acc"):
            if isinstance(st.get(key), torch.Tensor):
                out.append(st[key].clone())
    return out


def test_bad_steady_step_raises_at_the_boundary_with_the_masked_steps_undone():
    data = batches(12)
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model), _opt(ref)
    try:
        _lockstep(((model, opt), (ref, ref_opt)), data[:5])
        after5 = params_of(model)
        state5 = _device_state(opt)
        _grads(model, data[5], poison=True)
        opt.step()  # step 6: steady, its check deferred; masked
        assert opt._finite.pending == 2  # steps 5 and 6
        _grads(model, data[6])
        opt.step()  # step 7: fine, but masked too (the flag is sticky)
        for a, b in zip(params_of(model), after5):
            assert torch.equal(a, b)
        _grads(model, data[7])
        with pytest.raises(NonFiniteGradientError,
                           match=r"'fc1.weight'.* at step 6, found at step 8.*after step 5"):
            opt.step()  # step 8, a boundary: reads the flags
        assert opt.stats()["steps"] == 5
        for a, b in zip(params_of(model), after5):
            assert torch.equal(a, b)
        for a, b in zip(_device_state(opt), state5):
            assert torch.equal(a, b)
        # Going on from step 5 with the next batches equals a run that skipped the bad ones.
        _lockstep(((model, opt), (ref, ref_opt)), data[8:12])
        assert opt.stats()["steps"] == ref_opt.stats()["steps"] == 9
        _assert_same_params(model, opt, ref, ref_opt)
    finally:
        opt.close()
        ref_opt.close()


def test_a_param_first_seen_after_the_bad_step_is_rolled_back_too():
    """fc2 gets no gradient at the bad step 6, one at step 7 (masked like every step after
    the bad one): the rollback puts back its counters as well (its window's count and lr
    sum), so going on equals a run that skipped steps 6 and 7, bit for bit."""
    data = batches(12)
    model, ref = _model(), _model()
    opt, ref_opt = _opt(model), _opt(ref)
    try:
        _lockstep(((model, opt), (ref, ref_opt)), data[:5])
        fc2 = opt.state[model.fc2.weight]
        counts5 = {k: fc2[k] for k in ("device_step", "acc_count", "acc_lr")}
        _grads(model, data[5], poison=True)
        model.fc2.weight.grad = None
        opt.step()  # step 6: bad, fc2 not in it
        _grads(model, data[6])
        opt.step()  # step 7: masked, fc2 in it
        _grads(model, data[7])
        with pytest.raises(NonFiniteGradientError, match="at step 6"):
            opt.step()
        assert {k: fc2[k] for k in counts5} == counts5
        _lockstep(((model, opt), (ref, ref_opt)), data[8:12])
        _assert_same_params(model, opt, ref, ref_opt)
    finally:
        opt.close()
        ref_opt.close()


def test_a_save_reads_what_steady_steps_left():
    """state_dict() reads the unread checks first: a bad one raises there (rolled back), and
    the next state_dict() saves the state as after the step before the bad one."""
    data = batches(6)
    model = _model()
    with _opt(model) as opt:
        _train(model, opt, data[:5])
        after5 = params_of(model)
        _grads(model, data[5], poison=True)
        opt.step()  # step 6, deferred
        with pytest.raises(NonFiniteGradientError, match="at step 6, found before saving"):
            opt.state_dict()
        sd = opt.state_dict()
        assert sd["zenflow"]["global_step"] == 5
        for a, b in zip(params_of(model), after5):
            assert torch.equal(a, b)


def test_a_bad_step_that_waits_anyway_raises_at_once():
    """A boundary (step 4) reads its own check at once, as check_finite_at="step" does."""
    data = batches(4)
    model = _model()
    with _opt(model) as opt:
        _train(model, opt, data[:3])
        _grads(model, data[3], poison=True)
        with pytest.raises(NonFiniteGradientError, match="no optimizer state was changed by this"):
            opt.step()
        assert opt.stats()["steps"] == 3


def test_where_the_check_is_read():
    model = make_model()
    with pytest.raises(ValueError, match='check_finite_at="boundary" needs the Triton backend'):
        ZenFlowOptimizer(model.parameters(), backend="torch", check_finite_at="boundary")
    with pytest.raises(ConfigError, match='needs accumulate_on="device"'):
        ZenFlowOptimizer(model.parameters(), check_finite_at="boundary", accumulate_on="host")
    with pytest.raises(ConfigError, match=r"check_finite_at must be one of"):
        ZenFlowOptimizer(model.parameters(), check_finite_at="never")
    for at, backend, deferred in (("auto", "triton", False), ("boundary", "triton", True),
                                  ("step", "triton", False), ("auto", "torch", False)):
        with ZenFlowOptimizer(model.parameters(), backend=backend, check_finite_at=at) as opt:
            # "auto" defers only where a param is on a CUDA device: none here.
            assert opt._finite.at_boundary is deferred
