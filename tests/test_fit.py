"""Whether a model fits its device with a profile's settings, before anything is allocated
(zenflow_triton.fit): the counted bytes against what the optimizer then holds, and
from_profile's check, its "lean" choice and its messages. The device's memory is set by
the test (monkeypatched): CPU params have none to check."""

import warnings

import math

import pytest
import torch

from zenflow_triton import DoesNotFitError, ZenFlowOptimizer
from zenflow_triton import fit as F
from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.profiles import load_profile

from tests.support.profiles import pin_profile


@pytest.fixture(autouse=True)
def _pinned_a100(monkeypatch, tmp_path):
    """``a100-pcie4`` as these tests were written against (0.1 x 16 with the dense set),
    whatever bench/regenerate_profiles.py picks for the built-in."""
    pin_profile(monkeypatch, tmp_path)


class Tiny(torch.nn.Module):
    """An LM-shaped model: embeddings (the default dense set matches '*embed*'), two split
    matrices, a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 300, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.embed(x))))


def _train(opt, model, steps=6):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 300, (4, 8), generator=g)
        loss = model(x).float().logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("settings", [
    dict(), dict(accumulate_on="host"), dict(dense_params=()),
    dict(accumulator_dtype="bfloat16"), dict(topk_ratio=0.3, update_interval=2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counted_bytes_are_what_the_optimizer_holds_once_a_window_is_open(settings, dtype):
    model = Tiny().to(dtype)
    named = list(model.named_parameters())
    kw = dict(dict(topk_ratio=0.1, update_interval=4, min_offload_numel=1000), **settings)
    opt = ZenFlowOptimizer(named, lr=1e-3, **kw)
    try:
        _train(opt, model)
        held = opt.stats()["device_state_bytes"]
        counted = F.device_bytes(named, opt.config)
    finally:
        opt.close(finish=False)
    # the optimizer also holds a few scalars and the selection's small buffers
    assert counted.optimizer <= held <= counted.optimizer * 1.01 + 4096
    numel = sum(p.numel() for p in model.parameters())
    assert counted.params == counted.grads == numel * torch.empty(0, dtype=dtype).element_size()


def test_lean_settings_need_less_and_frozen_params_count_nothing():
    model = Tiny().to(torch.bfloat16)
    cfg = load_profile("a100-pcie4").config()
    full = F.device_bytes(model.named_parameters(), cfg)
    lean = F.device_bytes(model.named_parameters(), cfg.replace(**F.LEAN))
    assert lean.optimizer < full.optimizer and lean.params == full.params
    model.embed.weight.requires_grad_(False)
    frozen = F.device_bytes(model.named_parameters(), cfg)
    assert frozen.params == full.params - 300 * 64 * 2


def _capacity(monkeypatch, nbytes):
    """A device whose share for the optimizer (less the headroom) is ``nbytes``."""
    total = math.ceil(nbytes / (1 - F.DEVICE_HEADROOM))
    monkeypatch.setattr(F, "device_capacity_bytes", lambda device: total)


def _needs(model, **changes):
    cfg = load_profile("a100-pcie4").config(**changes)
    return F.device_bytes(model.named_parameters(), cfg).total


def test_from_profile_refuses_a_device_too_small_and_names_what_fits(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    full, lean = _needs(model), _needs(model, **F.LEAN)
    _capacity(monkeypatch, (full + lean) // 2)
    with pytest.raises(DoesNotFitError) as ei:
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5)
    msg = str(ei.value)
    assert "a100-pcie4" in msg and "accumulate_on='host', dense_params=()" in msg
    assert "fit='lean'" in msg and f"{full / 1e9:.1f} GB" in msg


def test_fit_lean_takes_the_lean_settings_with_a_warning_only_when_needed(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    full, lean = _needs(model), _needs(model, **F.LEAN)
    _capacity(monkeypatch, (full + lean) // 2)
    with pytest.warns(UserWarning, match="do not fit the device; taking accumulate_on='host'"):
        opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(),
                                            lr=2e-5, fit="lean")
    try:
        assert opt.config.accumulate_on == "host" and opt.config.dense_params == ()
        assert opt.config.topk_ratio == load_profile("a100-pcie4").settings["topk_ratio"]
    finally:
        opt.close()
    _capacity(monkeypatch, full)  # fits exactly: nothing changes, nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(),
                                            lr=2e-5, fit="lean")
    try:
        assert opt.config.accumulate_on == load_profile("a100-pcie4").settings.get(
            "accumulate_on", "device")
    finally:
        opt.close()


def test_an_override_that_fits_passes_and_skip_skips(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    full, lean = _needs(model), _needs(model, **F.LEAN)
    _capacity(monkeypatch, lean)
    opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5,
                                        **F.LEAN)
    opt.close()
    _capacity(monkeypatch, 1)
    opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5,
                                        fit="skip")
    opt.close()


def test_when_params_and_grads_alone_do_not_fit_it_says_so(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    streamed = F.device_bytes(model.named_parameters(),
                              load_profile("a100-pcie4").config(**F.STREAMED))
    floor = streamed.params + streamed.grads
    _capacity(monkeypatch, floor - 2)
    with pytest.raises(DoesNotFitError, match="the gradients in flight alone are"):
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), fit="lean")


def test_when_even_lean_does_not_fit_it_names_topk_ratio(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    cfg = load_profile("a100-pcie4").config(**F.STREAMED)
    streamed = F.device_bytes(model.named_parameters(), cfg)
    # (on a model this small, streaming holds more than the whole gradient: 2 x its largest)
    lean = min(streamed.total, _needs(model, **F.LEAN))
    floor = streamed.params + streamed.grads
    assert floor < lean
    _capacity(monkeypatch, (floor + lean) // 2)
    with pytest.raises(DoesNotFitError, match="lower topk_ratio"):
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters())


def test_a_bad_fit_value_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="fit must be one of"):
        ZenFlowOptimizer.from_profile("cpu", Tiny().named_parameters(), fit="maybe")


def test_cpu_params_are_not_checked():
    assert F.device_capacity_bytes(torch.device("cpu")) is None
    assert F.check(list(Tiny().parameters()), load_profile("cpu").config()) == {}


def test_the_constructor_checks_too_and_loses_nothing(monkeypatch):
    """Not only profiles: settings given by hand are checked the same way, before the
    optimizer holds anything (a second try with fit='lean' works on the same params)."""
    model = Tiny().to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    full, lean = _needs(model), _needs(model, **F.LEAN)
    _capacity(monkeypatch, (full + lean) // 2)
    kw = load_profile("a100-pcie4").settings
    with pytest.raises(DoesNotFitError, match="would need"):
        ZenFlowOptimizer(model.named_parameters(), lr=1e-3, **kw)
    with pytest.warns(UserWarning, match="fit='lean'"):
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, fit="lean", **kw)
    try:
        _train(opt, model, steps=2)
        assert opt.config.accumulate_on == "host"
    finally:
        opt.close()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_groups_of_tensors_or_named_pairs_count_alike():
    model = Tiny().to(torch.bfloat16)
    cfg = load_profile("a100-pcie4").config()
    named = list(model.named_parameters())
    want = F.device_bytes(named, cfg)
    as_pairs = [{"params": named[:2], "weight_decay": 0.0}, {"params": named[2:]}]
    as_names = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    assert F.device_bytes(as_pairs, cfg) == want == F.device_bytes(as_names, cfg)


def test_a_single_tensor_gets_torchs_own_error():
    with pytest.raises(TypeError, match="iterable of Tensors"):
        ZenFlowOptimizer(torch.nn.Parameter(torch.zeros(3, 3)))


def test_a_model_whose_gradient_does_not_fit_is_told_to_stream(monkeypatch):
    # 8 equal matrices: streamed, the device holds 2 of their gradients and the device
    # columns, not all 8
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False)
                                  for _ in range(8)]).to(torch.bfloat16)
    lean = _needs(model, **F.LEAN)
    streamed = _needs(model, **F.STREAMED)
    assert streamed < lean
    _capacity(monkeypatch, (streamed + lean) // 2)
    with pytest.raises(F.StreamingRequired, match="stream_grads=True would need") as ei:
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5)
    assert "max_grad_norm" in str(ei.value)
    with pytest.warns(UserWarning, match="stream_grads=True"):
        opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5,
                                            fit="lean")
    try:
        assert opt.config.stream_grads and opt.config.accumulate_on == "host"
    finally:
        opt.close()


def test_the_host_side_is_checked_against_the_memory_available(monkeypatch):
    model = Tiny().to(torch.bfloat16)
    cfg = load_profile("a100-pcie4").config()
    need = F.host_bytes(model.named_parameters(), cfg)
    # host-owned elements x (fp32 master + two fp32 moments + a bf16 outbox), their column
    # indices (int64), and each worker's fp32 scratch (the bf16 window mean staged in the
    # outbox is widened there piece by piece)
    from zenflow_triton.columns.selection import num_selected
    from zenflow_triton.host.adamw import STREAM_PIECE
    mats = [p.shape for n, p in model.named_parameters() if n in ("up.weight", "down.weight")]
    host = sum(r * (c - num_selected(c, cfg.topk_ratio)) for r, c in mats)
    index = sum(8 * (c - num_selected(c, cfg.topk_ratio)) for _, c in mats)
    scratch = torch.get_num_threads() * STREAM_PIECE * 4
    assert need == host * (12 + 2) + index + scratch
    _capacity(monkeypatch, 10**12)
    monkeypatch.setattr(F, "host_capacity_bytes", lambda: int(need / 0.9) - 1)
    with pytest.raises(DoesNotFitError, match="of host memory"):
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5)
    monkeypatch.setattr(F, "host_capacity_bytes", lambda: int(need / 0.9) + 2)
    ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5).close()
    assert F.host_capacity_bytes.__name__  # (the real one reads /proc/meminfo)


def test_fit_lean_that_turns_streaming_on_says_what_it_does_to_grad_and_clipping(monkeypatch):
    """A plain loop's clip_grad_norm_ after fit='lean' took stream_grads would clip the
    biases alone: the warning says .grad is None and to clip with max_grad_norm instead."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(
        torch.bfloat16)
    lean, streamed = _needs(model, **F.LEAN), _needs(model, **F.STREAMED)
    _capacity(monkeypatch, (streamed + lean) // 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5,
                                            fit="lean")
    try:
        assert opt.config.stream_grads
        text = " ".join(str(w.message) for w in caught if "fit='lean'" in str(w.message))
        for needed in (".grad is None", "clip_grad_norm_", "biases", "max_grad_norm="):
            assert needed in text, (needed, text)
        model(torch.ones(2, 256, dtype=torch.bfloat16)).float().sum().backward()
        assert model[0].weight.grad is None and model[0].bias.grad is not None  # as it says
    finally:
        opt.close(finish=False)
    # where only the lean settings are taken, nothing is said about streaming
    _capacity(monkeypatch, lean)
    with pytest.warns(UserWarning, match="fit='lean'") as rec:
        ZenFlowOptimizer.from_profile("a100-pcie4", model.named_parameters(), lr=2e-5,
                                      fit="lean").close()
    assert not any(".grad is None" in str(w.message) for w in rec)


def test_a_streamed_gradient_counts_the_device_columns_and_the_largest_gradient_twice():
    """Counted by hand, not by the function under test: with stream_grads each matrix keeps
    its device columns' gradient [rows, k] (bf16) and, at a selection, its column scores
    (fp32, one per column); a hook holds one whole gradient (the largest matrix's, bf16) and
    the gather of its host columns (at most as large) at once."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False),
                                torch.nn.Linear(256, 512, bias=False),
                                torch.nn.Linear(512, 256, bias=False)).to(torch.bfloat16)
    cfg = ZenFlowConfig(topk_ratio=0.1, min_offload_numel=1000, **F.STREAMED)
    shapes = [(256, 256), (512, 256), (256, 512)]  # [rows, cols] = [out, in]
    k = {256: 26, 512: 51}  # round(0.1 x cols)
    columns = sum(rows * k[cols] * 2 + cols * 4 for rows, cols in shapes)
    largest = 512 * 256 * 2
    got = F.device_bytes(model.named_parameters(), cfg)
    assert got.grads == columns + 2 * largest
    assert got.params == sum(r * c for r, c in shapes) * 2


@pytest.mark.parametrize("acc_dtype,acc_bytes", [("float32", 4), ("bfloat16", 2)])
def test_host_bytes_count_the_window_accumulator_where_the_host_sums(acc_dtype, acc_bytes):
    """Per host-owned element: fp32 master (4), two fp32 moments (8), the bf16 outbox (2) and,
    summed on the host over a window of more than one step, the accumulator; the column
    indices (8 B per host-owned column) and one worker's scratch (2 MiB: a bf16 window mean
    or sum is widened there; not for an fp32 sum)."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False),
                                torch.nn.Linear(64, 128, bias=False)).to(torch.bfloat16)
    host = 64 * (128 - 13) + 128 * (64 - 6)  # rows x (cols - round(0.1 x cols))
    index = 8 * ((128 - 13) + (64 - 6))
    scratch = 2 * 1024 * 1024
    kw = dict(topk_ratio=0.1, min_offload_numel=1000, accumulator_dtype=acc_dtype,
              host_threads=1)
    on_host = ZenFlowConfig(accumulate_on="host", update_interval=4, **kw)
    assert F.host_bytes(model.named_parameters(), on_host) == (
        host * (4 + 8 + 2 + acc_bytes) + index + (scratch if acc_bytes < 4 else 0))
    for no_sum in (on_host.replace(accumulate_on="device"), on_host.replace(update_interval=1)):
        assert F.host_bytes(model.named_parameters(), no_sum) == (
            host * (4 + 8 + 2) + index + scratch)


def test_the_host_check_names_the_leaner_host_settings_with_their_bytes(monkeypatch):
    """Where the host state does not fit, the error gives each leaner host setting's bytes
    (bf16 moments, a bf16 window sum, both, the sum on the device) and which of them fit."""
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False),
                                torch.nn.Linear(1024, 1024, bias=False)).to(torch.bfloat16)
    kw = dict(topk_ratio=0.1, update_interval=4, accumulate_on="host",
              min_offload_numel=1000, host_threads=1)
    cfg = ZenFlowConfig(**kw)
    named = list(model.named_parameters())
    need = F.host_bytes(named, cfg)
    both = F.host_bytes(named, cfg.replace(host_state_dtype="bfloat16",
                                           accumulator_dtype="bfloat16"))
    moments = F.host_bytes(named, cfg.replace(host_state_dtype="bfloat16"))
    assert both < moments < need
    _capacity(monkeypatch, 10**12)
    monkeypatch.setattr(F, "host_capacity_bytes", lambda: int((both + moments) / 2 / 0.9))
    with pytest.raises(DoesNotFitError) as ei:
        ZenFlowOptimizer(named, lr=1e-3, **kw).close()
    text = str(ei.value)
    assert f"host_state_dtype='bfloat16': {F._gb(moments)};" in text
    assert (f"host_state_dtype='bfloat16', accumulator_dtype='bfloat16': {F._gb(both)} (fits)"
            in text)
    device = F.host_bytes(named, cfg.replace(accumulate_on="device"))
    assert f"accumulate_on='device': {F._gb(device)}" in text
