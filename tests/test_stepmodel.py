"""The step-time model (autotune/stepmodel/): its arithmetic on hand-computable cases, its
monotonicity, the ZeRO-Offload equivalence, its memory accounting against the optimizer's
own stats(), the presets against transformers' models, the gh200 profile and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autotune import cli
from tests.support.profiles import pin_profile
from autotune import stepmodel as S
from tests.support.stepmodel import toy_hardware
from zenflow_triton import ZenFlowConfig
from zenflow_triton import profiles as P
from zenflow_triton.columns.selection import num_selected


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):  # no user profile shadows a built-in here
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "profiles"))


hw = toy_hardware


def one_layer(flops_per_token=6 * 2e6, tokens=100, small=1000) -> S.Workload:
    params = (S.ParamSpec("w", (1000, 2000)),) + ((S.ParamSpec("b", (small,)),) if small else ())
    return S.Workload("one", (S.Layer("l0", params, flops_per_token),), tokens=tokens, mfu=0.5)


def blocks(n=4, rows=512, cols=512, tokens=64) -> S.Workload:
    layers = tuple(S.Layer(f"b{i}", (S.ParamSpec(f"b{i}.w", (rows, cols)),
                                     S.ParamSpec(f"b{i}.n", (cols,))), 6.0 * rows * cols)
                   for i in range(n))
    return S.Workload("blocks", layers, tokens=tokens, mfu=0.5)


# ---- hand-computable cases -------------------------------------------------------------------
def test_zero_offload_step_is_compute_plus_link_plus_host_in_series():
    h, wl = hw(), one_layer()
    p = S.predict(h, wl, "zero-offload", update_interval=1)
    C = 6 * 2e6 * 100 / (0.5 * 1e12)           # 2.4 ms of forward + backward
    small = 1000 * 28 / 1e11                    # the bias's device AdamW
    down = up = 2e6 * 2 / 1e9                   # 2M bf16 elements each way at 1 GB/s
    host = 2e6 / 1e9
    assert p.step_time_s == pytest.approx(C + small + down + host + up, rel=1e-12)
    assert p.link_bytes_per_step == 2 * 2e6 * 2
    assert p.host_busy_fraction == pytest.approx(host / p.step_time_s, rel=1e-12)
    assert p.stall_fraction == pytest.approx((down + host + up) / p.step_time_s, rel=1e-12)


def test_link_bound_step_is_bytes_over_bandwidth():
    # No compute, no small params, a host that takes no time: the delayed-update pipeline
    # is limited by the link alone, one gradient (down) and one param copy (up) per step.
    wl = one_layer(flops_per_token=0.0, small=0)
    p = S.predict(hw(host_adam_elements_per_s=1e300), wl, "zero-offload-dpu")
    assert p.step_time_s == pytest.approx(2e6 * 2 / 1e9, rel=1e-12)
    assert p.stall_fraction == pytest.approx(1.0)
    sync = S.predict(hw(host_adam_elements_per_s=1e300), wl, "zero-offload")
    assert sync.step_time_s == pytest.approx(2 * 2e6 * 2 / 1e9, rel=1e-12)


@pytest.mark.parametrize("flops,link,host", [(6 * 2e6, 1e9, 1e9), (6 * 2e7, 1e9, 1e9),
                                             (6 * 2e6, 1e8, 1e10), (6 * 2e5, 1e10, 2e8),
                                             (6 * 2e7, 1e11, 1e8)])
def test_delayed_update_is_the_maximum_cycle_mean(flops, link, host):
    h, wl = hw(link_bandwidth=link, host_adam_elements_per_s=host), one_layer(flops)
    C = flops * 100 / 0.5e12
    F, B, s = C / 3, 2 * C / 3, 1000 * 28 / 1e11
    d = u = 2e6 * 2 / link
    hh = 2e6 / host
    expect = max(F + B + s, B + s + d, hh, u, (F + B + s + d + hh + u) / 2)
    assert S.predict(h, wl, "zero-offload-dpu").step_time_s == pytest.approx(expect, rel=1e-9)


def test_zenflow_synchronous_window_is_the_sum_of_its_parts():
    h, wl, K = hw(), one_layer(small=0), 4
    p = S.predict(h, wl, "zenflow", topk_ratio=0.1, update_interval=K, overlap=False)
    C = 6 * 2e6 * 100 / 0.5e12
    e_dev, e_host = 1000 * 200, 1000 * 1800     # k = round(0.1 * 2000) = 200 columns
    dev = e_dev * 28 / 1e11
    score = 2e6 * 2 / 1e11 / (16 * K)           # one gradient read per selection, amortised
    acc = e_host * (2 + 8) / 1e11               # bf16 grad + fp32 accumulator read/write
    mean = e_host * (4 + 2) / 1e11
    down = up = e_host * 2 / 1e9
    host = e_host / 1e9
    scatter = e_host * 4 / 1e11
    window = K * (C + dev + score + acc) + mean + down + host + up + scatter
    assert p.step_time_s == pytest.approx(window / K, rel=1e-12)
    assert p.link_bytes_per_step == pytest.approx(2 * e_host * 2 / K)
    assert p.window_time_s == pytest.approx(window, rel=1e-12)


@pytest.mark.parametrize("host", [1e10, 1e8])  # host hidden / host bound
def test_zenflow_overlapped_window(host):
    h, wl, K = hw(host_adam_elements_per_s=host, link_bandwidth=1e10), one_layer(small=0), 4
    p = S.predict(h, wl, "zenflow", topk_ratio=0.1, update_interval=K, overlap=True)
    C = 6 * 2e6 * 100 / 0.5e12
    e_dev, e_host = 1000 * 200, 1000 * 1800
    step_dev = C + e_dev * 28 / 1e11 + 2e6 * 2 / 1e11 / (16 * K) + e_host * 10 / 1e11
    mean, scatter = e_host * 6 / 1e11, e_host * 4 / 1e11
    down = up = e_host * 2 / 1e10   # shorter than a step: the next accumulation never waits
    # the job launched at a boundary is applied at the next one; its params-up copy is
    # issued there (the apply point), so it is never hidden
    window = max(K * step_dev, down + e_host / host) + up + scatter + mean
    assert p.window_time_s == pytest.approx(window, rel=1e-12)
    busy = K * step_dev + mean + scatter
    assert p.stall_fraction == pytest.approx((window - busy + K * (p.step_time_s - window / K))
                                             / (K * p.step_time_s), rel=1e-9)
    early = S.predict(h, wl, "zenflow", topk_ratio=0.1, update_interval=K,
                      prefetch_result=True)
    assert early.window_time_s <= p.window_time_s


def test_overlapped_offload_of_one_layer_is_zero_offload_and_pipelining_helps():
    h = hw(host_adam_elements_per_s=5e8)
    one = one_layer(small=0)
    assert (S.predict(h, one, "overlapped-offload").step_time_s
            == pytest.approx(S.predict(h, one, "zero-offload").step_time_s, rel=1e-12))
    wl = blocks(n=8)
    ov = S.predict(h, wl, "overlapped-offload")
    zo = S.predict(h, wl, "zero-offload")
    F = sum(l.flops_per_token for l in wl.layers) * wl.tokens / 0.5e12 / 3
    host = wl.numel / 5e8 - 8 * 512 / 5e8
    assert ov.step_time_s < zo.step_time_s
    # exact AdamW: the first layer's params come back last, so the forward cannot overlap
    # the host's work of the same step
    assert ov.step_time_s >= F + host


def test_adamw_is_compute_plus_memory_bound_update_and_sharded_over_gpus():
    h, wl = hw(), one_layer()
    C = 6 * 2e6 * 100 / 0.5e12
    assert S.predict(h, wl, "adamw").step_time_s == pytest.approx(
        C + wl.numel * 28 / 1e11, rel=1e-12)
    assert S.predict(h, wl, "adamw", gpus=4).step_time_s == pytest.approx(
        C + wl.numel / 4 * 28 / 1e11, rel=1e-12)
    p = S.predict(h, wl, "adamw")
    assert p.link_bytes_per_step == 0 and p.host_busy_fraction == 0 and p.stall_fraction == 0


# ---- the link: each direction its own figure, slower while the other is busy ---------------
def test_each_link_lane_divides_by_its_own_directions_figure():
    h = hw(link_h2d=2e9, link_d2h=1e9)  # host to device (up) 2 GB/s, device to host 1 GB/s
    wl = one_layer()
    p = S.predict(h, wl, "zero-offload", update_interval=1)
    C = 6 * 2e6 * 100 / (0.5 * 1e12)
    down, up, host = 2e6 * 2 / 1e9, 2e6 * 2 / 2e9, 2e6 / 1e9
    assert p.step_time_s == pytest.approx(C + 1000 * 28 / 1e11 + down + host + up, rel=1e-12)
    # synchronous: the directions never overlap, so a contended figure changes nothing
    slow = hw(link_h2d=2e9, link_d2h=1e9, link_h2d_while_d2h=1e8, link_d2h_while_h2d=1e8)
    assert S.predict(slow, wl, "zero-offload", update_interval=1).step_time_s == p.step_time_s


@pytest.mark.parametrize("up,down,r_up,r_down,up_end,down_end", [
    (1.0, 1.0, 0.5, 1.0, 1.5, 1.0),   # up at half rate while down runs, then alone
    (2.0, 1.0, 0.5, 0.5, 3.0, 2.0),   # both at half rate for 2 s, then up alone
    (1.0, 1.0, 1.0, 1.0, 1.0, 1.0)])  # no contention
def test_a_transfer_slows_for_the_share_of_it_the_other_direction_is_busy(
        up, down, r_up, r_down, up_end, down_end):
    from autotune.stepmodel.timeline import run_windows, steady_window

    def body(L, w, i):  # 10 s of compute, then one copy each way at once; wait for both
        start = L.free["device"]
        t = L.run("device", 10.0, "compute")
        a = L.run("link-up", up, "up", [t])
        b = L.run("link-down", down, "down", [t])
        L.run("device", 0.0, "wait", [a, b])
        return start

    lanes, starts = run_windows(body, 1, {"link-up": r_up, "link-down": r_down})
    window, segs, busy = steady_window(lanes, starts)
    assert busy["link-up"] == pytest.approx(up_end, rel=1e-8)
    assert busy["link-down"] == pytest.approx(down_end, rel=1e-8)
    assert window == pytest.approx(10.0 + max(up_end, down_end), rel=1e-8)


def _streaming(**link) -> S.Prediction:
    """A link-bound gradient stream: each step's host columns go down during backward while
    the last window's result goes up."""
    layers = tuple(S.Layer(f"b{i}", (S.ParamSpec(f"b{i}.w", (512, 512)),), 6.0 * 512 * 512)
                   for i in range(4))
    wl = S.Workload("blocks", layers, tokens=64, mfu=0.5)
    return S.predict(hw(host_adam_elements_per_s=1e10, **link), wl, "zenflow",
                     topk_ratio=0.1, update_interval=1, stream_grads=True)


def test_a_lower_contended_figure_gives_a_longer_streaming_step():
    equal = _streaming(link_h2d_while_d2h=1e9, link_d2h_while_h2d=1e9)
    assert equal.step_time_s == _streaming().step_time_s  # equal figures: no contention
    half = _streaming(link_h2d_while_d2h=0.5e9)
    quarter = _streaming(link_h2d_while_d2h=0.25e9, link_d2h_while_h2d=0.5e9)
    assert equal.step_time_s < half.step_time_s < quarter.step_time_s
    # above the uncontended figure it is the uncontended one (busy never speeds a copy up)
    assert _streaming(link_h2d_while_d2h=5e9).step_time_s == equal.step_time_s
    # state-swap streams the state both ways at once: the same
    wl = S.Workload.from_preset("opt-350m", tokens=512)
    swap = {r: S.predict(hw(link_h2d_while_d2h=r), wl, "state-swap",
                         resident_fraction=0.0).step_time_s for r in (1e9, 0.5e9)}
    assert swap[0.5e9] > swap[1e9]


OLD_A100 = {"name": "old-a100", "hardware": {
    "bf16_tensor_tflops_dense": 312, "fp32_tflops": 19.5, "memory_bandwidth_gb_s": 1935,
    "device_memory_gb": 80, "link_bandwidth_gb_s": 64, "link_bandwidth_per_direction_gb_s": 32.0}}
"""The a100-pcie4 facts the model read before the link figures per direction existed."""


@pytest.mark.parametrize("mode,settings,step", [
    ("zero-offload", {}, 6.460424162820786),
    ("zero-offload-dpu", {}, 4.21134336),
    ("overlapped-offload", {}, 4.713870853776421),
    ("state-swap", {}, 2.719047688923049),
    ("zenflow", {}, 1.589419933438981),
    ("zenflow", dict(stream_grads=True), 2.2724239509380193),
    ("zenflow", dict(update_interval=1), 4.384565218894057)])
def test_an_old_style_profile_predicts_as_before_bit_for_bit(mode, settings, step):
    """The step times of the model before the link per direction (its code at the commit
    before, on the same facts): a profile without the new fields gives them exactly, and so
    does one with the datasheet figure in every new field."""
    wl = S.Workload.from_preset("llama2-7b")
    st = dict(dict(topk_ratio=0.1, update_interval=4), **settings)
    assert S.predict(S.Hardware.from_profile(OLD_A100), wl, mode, **st).step_time_s == step
    same = dict(OLD_A100["hardware"], link_h2d_gb_s=32.0, link_d2h_gb_s=32.0,
                link_h2d_while_d2h_gb_s=32.0, link_d2h_while_h2d_gb_s=32.0)
    assert S.predict(S.Hardware.from_profile({"name": "x", "hardware": same}), wl, mode,
                     **st).step_time_s == step


def test_profiles_give_each_direction_and_say_where_a_figure_falls_back():
    a100 = S.Hardware.from_profile("a100-pcie4")
    assert (a100.h2d, a100.d2h, a100.h2d_while_d2h, a100.d2h_while_h2d) == (
        25e9, 25e9, 12.5e9, 25e9)
    assert a100.link_bandwidth == 32e9  # the datasheet figure, kept
    assert "no contention" in a100.sources["link_d2h_while_h2d_gb_s"]
    gh = S.Hardware.from_profile("gh200")
    assert gh.h2d == 346e9 and gh.d2h == 450e9 and gh.link_contention() == {
        "link-up": 1.0, "link-down": 1.0}
    assert "datasheet" in gh.sources["link_d2h_gb_s"]
    h100 = S.Hardware.from_profile("h100-pcie5")
    assert (h100.h2d, h100.d2h) == (35e9, 53e9)
    # measured figures alone (no datasheet figure): the slower direction stands in for it
    own = S.Hardware.from_profile({"name": "own", "hardware": {
        "bf16_tensor_tflops_dense": 100, "memory_bandwidth_gb_s": 1000, "link_h2d_gb_s": 20,
        "link_d2h_gb_s": 24}})
    assert own.link_bandwidth == 20e9 and own.missing_device_facts() == []
    # a what-if link: the same figure both ways, no contention
    fast = a100.with_link(100e9)
    assert (fast.h2d, fast.d2h, fast.h2d_while_d2h) == (100e9, 100e9, 100e9)


# ---- the equivalence -------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["a100-pcie4", "h100-pcie5", "gh200"])
@pytest.mark.parametrize("model,gpus", [("llama2-7b", 1), ("opt-350m", 4), ("qwen2.5-3b", 2)])
def test_zenflow_zero_offload_mode_predicts_exactly_the_zero_offload_step(profile, model, gpus):
    h, wl = S.Hardware.from_profile(profile), S.Workload.from_preset(model)
    zf = S.predict(h, wl, "zenflow", gpus=gpus, topk_ratio=0.0, update_interval=1,
                   overlap=False, dense_params=())  # ZeRO-Offload mode: no dense set
    zo = S.predict(h, wl, "zero-offload", gpus=gpus, window_steps=1)
    for key in ("modelled_step_time_s", "stall_fraction", "link_bytes_per_step",
                "link_down_bytes_per_step", "link_up_bytes_per_step", "host_busy_fraction"):
        assert getattr(zf, key) == getattr(zo, key), key
    # the host: the library's own ZeRO-Offload mode, and DeepSpeed's fp32 gradient besides
    peer = zo.memory["host"][S.DEEPSPEED_FP32_GRADIENT]
    assert zf.memory["host"] == {k: v for k, v in zo.memory["host"].items()
                                 if k != S.DEEPSPEED_FP32_GRADIENT}
    assert peer == zf.memory["host"]["master (fp32)"]  # 4 B per offloaded element, each
    assert zf.step_time_s == zo.step_time_s
    # ZeRO-Offload streams its gradients off the device in buckets during backward: its
    # memory is ZenFlow's with stream_grads (no resident full gradient), not without
    streamed = S.predict(h, wl, "zenflow", gpus=gpus, topk_ratio=0.0, update_interval=1,
                         overlap=False, dense_params=(), stream_grads=True)
    assert streamed.device_memory_bytes == zo.device_memory_bytes
    assert zf.device_memory_bytes > zo.device_memory_bytes


# ---- monotonicity ----------------------------------------------------------------------------
SETTINGS = [dict(topk_ratio=0.1, update_interval=4), dict(topk_ratio=0.1, update_interval=4,
                                                           overlap=False),
            dict(topk_ratio=0.05, update_interval=8, accumulate_on="host"),
            dict(topk_ratio=0.0, update_interval=1, overlap=False),
            dict(topk_ratio=0.3, update_interval=2, accumulate_on="host", overlap=False),
            dict(topk_ratio=0.0, update_interval=1)]


def _steps(h, wl, gpus=1):
    out = []
    for st in SETTINGS:
        for mode in S.MODES:
            out.append(S.predict(h, wl, mode, gpus=gpus, **st).modelled_step_time_s)
    return out


@pytest.mark.parametrize("model,gpus", [("opt-350m", 1), ("llama2-7b", 4)])
def test_more_link_bandwidth_never_slows_a_step(model, gpus):
    wl = S.Workload.from_preset(model, tokens=2048)
    base = S.Hardware.from_profile("a100-pcie4")
    prev = None
    for gb in (4, 16, 32, 64, 128, 450, 2000):
        cur = _steps(base.with_link(gb * 1e9), wl, gpus)
        if prev is not None:
            assert all(c <= p * (1 + 1e-12) for c, p in zip(cur, prev)), gb
        prev = cur


@pytest.mark.parametrize("model,gpus", [("opt-350m", 1), ("llama2-7b", 4)])
def test_a_more_contended_link_never_speeds_a_step(model, gpus):
    wl = S.Workload.from_preset(model, tokens=2048)
    base = S.Hardware.from_profile("a100-pcie4")
    prev = None
    for gb in (25, 12.5, 6, 2):
        cur = _steps(dataclasses.replace(base, link_h2d_while_d2h=gb * 1e9,
                                         link_d2h_while_h2d=gb * 1e9), wl, gpus)
        if prev is not None:
            assert all(c >= p * (1 - 1e-12) for c, p in zip(cur, prev)), gb
        prev = cur


@pytest.mark.parametrize("model,gpus", [("opt-350m", 1), ("llama2-7b", 4)])
def test_more_host_throughput_never_slows_a_step(model, gpus):
    wl = S.Workload.from_preset(model, tokens=2048)
    prev = None
    for rate in (2e8, 1e9, 4e9, 1.6e10, 1e11):
        cur = _steps(S.Hardware.from_profile("h100-pcie5", host_adam_elements_per_s=rate), wl,
                     gpus)
        if prev is not None:
            assert all(c <= p * (1 + 1e-12) for c, p in zip(cur, prev)), rate
        prev = cur


def test_faster_device_never_slows_a_step():
    wl = S.Workload.from_preset("opt-350m")
    base = S.Hardware.from_profile("a100-pcie4")
    prev = None
    for scale in (0.25, 1, 4):
        h = S.Hardware(**{**base.__dict__, "device_flops": base.device_flops * scale,
                          "device_memory_bandwidth": base.device_memory_bandwidth * scale})
        cur = _steps(h, wl)
        if prev is not None:
            assert all(c <= p * (1 + 1e-12) for c, p in zip(cur, prev)), scale
        prev = cur


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
@pytest.mark.parametrize("interval", [1, 4])
def test_larger_topk_ratio_never_increases_zenflow_link_bytes(accumulate_on, interval):
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("qwen2.5-3b")
    got = [S.predict(h, wl, "zenflow", topk_ratio=r, update_interval=interval,
                     accumulate_on=accumulate_on).link_bytes_per_step
           for r in (0.0, 0.01, 0.05, 0.1, 0.3, 0.7, 1.0)]
    assert all(b <= a for a, b in zip(got, got[1:]))
    assert got[-1] == 0 and got[0] > 0


def test_link_bytes_per_gpu_fall_as_one_over_gpus():
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("llama2-7b")
    for mode in ("zero-offload", "zenflow"):
        one = S.predict(h, wl, mode, gpus=1).link_bytes_per_step
        four = S.predict(h, wl, mode, gpus=4).link_bytes_per_step
        assert four == pytest.approx(one / 4, rel=1e-12)


# ---- link bytes as the optimizer counts them (docs/host.md, "Measured on CPU") ----------------
def test_link_bytes_match_the_measured_ratios():
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("llama2-7b")
    model_bytes = wl.numel * 2
    # the measured ratios are of a model of split matrices only (no dense set)
    ratio = {acc: S.predict(h, wl, "zenflow", accumulate_on=acc,
                            dense_params=()).link_bytes_per_step
             / model_bytes for acc in ("device", "host")}
    assert S.predict(h, wl, "zero-offload").link_bytes_per_step / model_bytes == \
        pytest.approx(2.0, abs=1e-3)
    assert ratio["device"] == pytest.approx(0.9 * 2 / 4, abs=2e-3)       # measured 0.46x
    assert ratio["host"] == pytest.approx(0.9 + 0.9 / 4, abs=2e-3)       # measured 1.13x


# ---- memory: the optimizer's own byte accounting -----------------------------------------------
@pytest.mark.parametrize("cfg", [dict(), dict(topk_ratio=0.0, update_interval=1, overlap=False)])
def test_memory_matches_the_optimizers_stats(cfg):
    from zenflow_triton import ZenFlowOptimizer

    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)]
                                ).to(torch.bfloat16)
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(1)
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, host_threads=threads, **cfg) as opt:
        for _ in range(9):
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            opt.step()
        st = opt.stats()
    wl = S.Workload.from_module(model)
    pred = S.predict(hw(), wl, "zenflow", host_threads=threads, **cfg)
    dev = S.optimizer_state_bytes(pred.memory["device"])
    # the bounce buffers cross a CUDA link only: a CPU run has none
    host = sum(v for k, v in pred.memory["host"].items() if k != "bounce buffers (pinned)")
    assert dev == pytest.approx(st["device_state_bytes"], rel=0.01, abs=1024)
    assert host == pytest.approx(st["host_state_bytes"], rel=0.01)
    acts = sum(S.activation_bytes(wl).values())
    assert pred.device_memory_bytes == pytest.approx(dev + 2 * 2 * wl.numel + acts, abs=1)


def test_memory_per_param_follows_the_readme_table():
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("llama2-7b")
    n = wl.numel

    def per_param(mode, **st):  # the table's model has split matrices only: no dense set
        m = S.predict(h, wl, mode, dense_params=(), **st).memory
        return S.optimizer_state_bytes(m["device"]) / n, sum(m["host"].values()) / n

    dev, host = per_param("zenflow")
    assert dev == pytest.approx(4.8, abs=0.02) and host == pytest.approx(12.6, abs=0.02)
    dev, host = per_param("zenflow", accumulate_on="host")
    assert dev == pytest.approx(1.2, abs=0.02) and host == pytest.approx(16.2, abs=0.02)
    dev, host = per_param("zenflow", host_state_dtype="bfloat16", accumulator_dtype="bfloat16")
    assert dev == pytest.approx(3.0, abs=0.02) and host == pytest.approx(9.0, abs=0.02)
    # DeepSpeed's layout: fp32 master, m, v and the fp32 gradient partition (16 B); the
    # delayed update's outbox in the param dtype besides (2 B)
    assert per_param("zero-offload")[1] == pytest.approx(16.0, abs=0.02)
    assert per_param("zero-offload-dpu")[1] == pytest.approx(18.0, abs=0.02)
    assert per_param("adamw")[0] == pytest.approx(12.0, abs=1e-9)
    assert S.predict(h, wl, "adamw").fits is False          # 16 B/param of 6.7B > 80 GB
    assert S.predict(h, wl, "adamw").step_time_s is None
    assert S.predict(h, wl, "adamw", gpus=4).fits is True   # state sharded over 4 GPUs


# ---- workloads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,published", [("llama2-7b", 6.74e9), ("llama2-13b", 13.02e9),
                                              ("qwen2.5-3b", 3.09e9), ("opt-350m", 331e6)])
def test_presets_have_the_published_parameter_counts(preset, published):
    assert S.Workload.from_preset(preset).numel == pytest.approx(published, rel=2e-3)


def test_presets_match_transformers_models_built_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    builds = {
        "llama2-7b": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)),
        "qwen2.5-3b": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
            num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True)),
        "opt-350m": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
            hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16,
            vocab_size=50272, word_embed_proj_dim=512, do_layer_norm_before=False,
            max_position_embeddings=2048)),
    }
    for name, build in builds.items():
        with torch.device("meta"):
            model = build()
        got = S.Workload.from_module(model, tokens=1024)
        want = S.Workload.from_preset(name, tokens=1024, seq_len=1)
        assert got.numel == want.numel, name
        assert sorted(p.shape for p in got.params) == sorted(p.shape for p in want.params)
        # matmul FLOPs (tied heads count as matmuls); the preset adds attention, 12 d seq
        arch = S.PRESETS[name]
        attn = 12.0 * arch["hidden"] * 1 * arch["layers"]
        assert got.flops_per_token == pytest.approx(want.flops_per_token - attn, rel=1e-12)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(S.StepModelError, match="llama2-7b.*opt-350m.*qwen2.5-3b"):
        S.Workload.from_preset("llama-7b")


# ---- hardware ----------------------------------------------------------------------------------
def test_hardware_from_profiles():
    a100 = S.Hardware.from_profile("a100-pcie4")
    assert a100.link_bandwidth == 32e9 and a100.device_flops == 312e12
    assert a100.host_rate(1) == S.DEFAULT_HOST_CORES_PER_ACCELERATOR * \
        S.DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE
    gh = S.Hardware.from_profile("gh200")
    assert gh.link_bandwidth == 450e9 and gh.device_memory_bandwidth == 4000e9
    assert gh.host_cores == 72 and gh.accelerators_per_node == 1
    assert gh.host_rate(1) == gh.host_rate(8)        # each GH200 has its own Grace
    node = S.Hardware.from_profile({"name": "x", "hardware": {
        "bf16_tensor_tflops_dense": 100, "memory_bandwidth_gb_s": 1000,
        "link_bandwidth_gb_s": 64, "host_adam_elements_per_s": 8e9}})
    assert node.link_bandwidth == 32e9               # both directions given: halved
    assert node.host_rate(1) == 8e9 and node.host_rate(4) == 2e9 and node.host_rate(16) == 1e9


def test_cpu_profile_has_host_facts_only():
    cpu = S.Hardware.from_profile("cpu", host_adam_elements_per_s=1e9)
    assert cpu.host_cores >= 1 and cpu.host_rate() == 1e9
    wl = S.Workload.from_preset("opt-350m")
    with pytest.raises(S.StepModelError, match="bf16_tensor_tflops_dense"):
        S.predict(cpu, wl, "zenflow")
    e_host = sum(p.shape[0] * (p.cols - num_selected(p.cols, 0.1)) for p in wl.params
                 if p.is_matrix(4096, ZenFlowConfig().dense_params))
    assert S.host_update_seconds(cpu, wl) == pytest.approx(e_host / 1e9)
    e_all = sum(p.shape[0] * (p.cols - num_selected(p.cols, 0.1)) for p in wl.params
                if p.is_matrix(4096))
    assert e_all > e_host  # OPT's embeddings are in the dense set
    assert S.host_update_seconds(cpu, wl, dense_params=()) == pytest.approx(e_all / 1e9)


def test_gh200_profile_is_valid_cited_and_listed():
    prof = P.load_profile("gh200")
    assert prof.source == "builtin" and prof.provenance["source"] == "modelled"
    assert prof.provenance["measured"] is False
    assert any("2505.12242" in c["url"] for c in prof.provenance["citations"])
    hwd = prof.hardware
    assert hwd["citation"]["url"].startswith("https://")
    assert hwd["link_bandwidth_per_direction_gb_s"] * 2 == hwd["link_bandwidth_gb_s"] == 900
    assert hwd["memory_bandwidth_gb_s"] > P.load_profile("h100-sxm5").hardware[
        "memory_bandwidth_gb_s"]
    assert "gh200" in [p.name for p in P.list_profiles()]


def test_zenflow_advantage_shrinks_with_a_fast_link():
    wl = S.Workload.from_preset("llama2-7b")
    speedup = {}
    for name in ("a100-pcie4", "h100-pcie5", "gh200"):
        p = S.predict_all(S.Hardware.from_profile(name), wl)
        speedup[name] = p["zero-offload"].step_time_s / p["zenflow"].step_time_s
        link = sum(s.duration for s in p["zero-offload"].timeline if s.lane.startswith("link"))
        if name == "gh200":  # NVLink-C2C: the link is a small part of the ZeRO-Offload step
            assert link / p["zero-offload"].window_time_s < 0.05
    assert speedup["gh200"] < speedup["a100-pcie4"] and speedup["gh200"] < speedup["h100-pcie5"]


# ---- outputs -----------------------------------------------------------------------------------
def test_timeline_lanes_and_steady_state():
    p = S.predict(S.Hardware.from_profile("h100-pcie5"), S.Workload.from_preset("opt-350m"),
                  "zenflow", accumulate_on="host", update_interval=8)
    assert {s.lane for s in p.timeline} <= set(S.LANES)
    assert all(0 <= s.start <= s.end <= p.window_time_s * (1 + 1e-12) for s in p.timeline)
    assert p.window_steps == 8
    assert p.step_time_s >= p.window_time_s / 8      # plus the amortised reselection drain
    lanes = {lane: sum(s.duration for s in p.timeline if s.lane == lane) for lane in S.LANES}
    assert lanes["host"] == pytest.approx(p.host_busy_fraction * 8 * p.step_time_s, rel=1e-9)
    assert lanes["link-down"] > lanes["link-up"] > 0  # the host-owned columns cross each step


def test_plot_timelines_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    preds = S.predict_all(S.Hardware.from_profile("a100-pcie4"),
                          S.Workload.from_preset("opt-350m"))
    out = S.plot_timelines(preds, tmp_path / "t.png", title="test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_reports_every_published_point():
    rows, assumptions = S.calibration()
    assert len(rows) == 6 and assumptions["gpus"] == 4
    by = {r["quantity"]: r for r in rows}
    assert by["link bytes/step, ZeRO-Offload (x model size)"]["model"] == \
        pytest.approx(2.0, abs=1e-3)
    assert by["link bytes/step, ZenFlow (x model size)"]["model"] == pytest.approx(1.125,
                                                                                   abs=2e-3)
    for r in rows:
        assert r["rel_error"] == pytest.approx((r["model"] - r["published"]) / r["published"])
    assert "| quantity |" in S.calibration_table()


# ---- CLI ---------------------------------------------------------------------------------------
def test_cli_predict_json(capsys):
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model", "llama2-7b",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(S.MODES)
    keys = {"step_time_s", "stall_fraction", "link_bytes_per_step", "host_busy_fraction",
            "device_memory_bytes", "host_memory_bytes"}
    for mode, d in out.items():
        assert keys <= set(d), mode
        assert isinstance(d["device_memory_bytes"], int) and d["host_memory_bytes"] >= 0
    assert out["adamw"]["step_time_s"] is None and out["adamw"]["fits"] is False
    prof = P.load_profile("a100-pcie4")  # the profile's settings are the default
    assert out["zenflow"]["settings"]["topk_ratio"] == prof.settings["topk_ratio"]
    assert out["zenflow"]["settings"]["update_interval"] == prof.settings["update_interval"]
    assert "settings" not in out["zero-offload"]
    assert out["zenflow"]["step_time_s"] < out["zero-offload"]["step_time_s"]


def test_cli_predict_options_change_the_prediction(capsys):
    args = ["predict", "--profile", "h100-pcie5", "--model", "opt-350m", "--json"]
    assert cli.main(args) == 0
    base = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--gpus", "2", "--tokens", "8192", "--micro-batch-tokens", "8192",
                            "--topk-ratio", "0.2", "--update-interval", "8"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["zenflow"]["settings"]["topk_ratio"] == 0.2
    assert other["zenflow"]["settings"]["update_interval"] == 8
    assert other["zero-offload"]["link_bytes_per_step"] == pytest.approx(
        base["zero-offload"]["link_bytes_per_step"] / 2, abs=1)
    # the default micro-batch is at most 4096 tokens: two passes a step, and ZeRO-Offload's
    # gradient sum goes down after the first and up during the second
    assert cli.main(args + ["--gpus", "2", "--tokens", "8192"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["zero-offload"]["link_bytes_per_step"] == pytest.approx(
        2 * other["zero-offload"]["link_bytes_per_step"], abs=2)
    # a reselection every window drains the host job every window: a slower step
    assert cli.main(args + ["--update-interval", "4", "--select-interval", "4"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert every["zenflow"]["settings"]["select_interval"] == 4
    assert cli.main(args + ["--update-interval", "4", "--select-interval", "64"]) == 0
    rare = json.loads(capsys.readouterr().out)
    assert every["zenflow"]["step_time_s"] > rare["zenflow"]["step_time_s"]


def test_apply_delay_hides_the_host_job_behind_fewer_steps(capsys, monkeypatch, tmp_path):
    """apply_delay = d: the host job hides behind d steps of device time instead of a window.
    Llama-2-7B on a100-pcie4 at 0.1 x 4 is host-bound (the job takes about 3 steps): a
    delay of 3 or 4 (the default) costs nothing, 2 and 1 cost more each step; where the job
    takes less than one step (a fast host), no delay costs anything."""
    pin_profile(monkeypatch, tmp_path)  # (the command line below reads its settings)
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("llama2-7b")

    def step(hw_, d):
        return S.predict(hw_, wl, "zenflow", topk_ratio=0.1, update_interval=4,
                         apply_delay=d).step_time_s

    t = {d: step(h, d) for d in (None, 1, 2, 3, 4)}
    assert t[4] == t[None] == pytest.approx(t[3], rel=1e-9)
    assert t[1] > t[2] > t[3]
    fast = S.Hardware.from_profile("a100-pcie4", host_adam_elements_per_s=1e12)
    assert step(fast, 1) == pytest.approx(step(fast, 4), rel=1e-9)
    pred = S.predict(h, wl, "zenflow", topk_ratio=0.1, update_interval=4, apply_delay=2)
    assert pred.to_dict()["settings"]["apply_delay"] == 2
    # and from the command line
    args = ["predict", "--profile", "a100-pcie4", "--model", "llama2-7b", "--json",
            "--topk-ratio", "0.1", "--update-interval", "4"]
    assert cli.main(args + ["--apply-delay", "1"]) == 0
    got = json.loads(capsys.readouterr().out)["zenflow"]
    assert got["settings"]["apply_delay"] == 1
    assert got["step_time_s"] == pytest.approx(t[1], rel=1e-9)
    # an interval shorter than the profile's delay drops the profile's delay, as it does
    # the profile's select_interval
    assert cli.main(args[:-1] + ["2"]) == 0
    assert json.loads(capsys.readouterr().out)["zenflow"]["settings"]["update_interval"] == 2
    assert cli.main(args + ["--apply-delay", "5"]) == 2
    assert "apply_delay must be in [1, update_interval=4]" in capsys.readouterr().err


def test_fsdp2_shards_the_device_side_and_leaves_the_host_side_as_under_ddp():
    """Under FSDP2 each GPU holds 1/N of the params, gradients and device state (column
    indices whole: every rank makes the same selection) and updates only its rows; the host
    side is DDP's (the offloaded rows were already sharded 1/N). One GPU: no difference."""
    h, wl = S.Hardware.from_profile("a100-pcie4"), S.Workload.from_preset("llama2-13b")
    for mode in S.MODES:
        one = S.predict(h, wl, mode, gpus=1).to_dict()
        assert S.predict(h, wl, mode, gpus=1, sharding="fsdp2").to_dict() == one
    for mode in S.MODES:  # state-swap: the same resident share (the most that fits differs)
        ddp = S.predict(h, wl, mode, gpus=4, resident_fraction=0.0)
        fsdp = S.predict(h, wl, mode, gpus=4, sharding="fsdp2", resident_fraction=0.0)
        assert fsdp.memory["host"] == ddp.memory["host"]
        assert fsdp.link_bytes_per_step == ddp.link_bytes_per_step
        for key, v in ddp.memory["device"].items():
            if key in ("column indices", "window accumulator (rank's rows)",
                       "optimizer state (sharded 1/N)", "resident Adam state (sharded 1/N)",
                       "two streaming buffers") or key.startswith(("activations", "logits")):
                # (activations: each GPU's own tokens under either)
                assert fsdp.memory["device"][key] == v     # whole, or sharded already
            else:
                assert fsdp.memory["device"][key] == pytest.approx(v / 4, rel=1e-12), key
        assert fsdp.modelled_step_time_s <= ddp.modelled_step_time_s
    # zenflow's device work (its rows' selective AdamW, scoring, scatter) is 1/4 as long
    zf = {s: S.predict(h, wl, "zenflow", gpus=4, sharding=s, overlap=False)
          for s in ("ddp", "fsdp2")}
    assert zf["fsdp2"].modelled_step_time_s < zf["ddp"].modelled_step_time_s
    assert S.predict(h, wl, "zenflow", gpus=4, sharding="fsdp2").fits
    assert not S.predict(h, wl, "zenflow", gpus=4).fits  # 13B whole on each 80 GB GPU
    with pytest.raises(S.StepModelError, match="unknown sharding 'zero3'.*ddp, fsdp2"):
        S.predict(h, wl, "zenflow", gpus=4, sharding="zero3")


def test_cli_predict_sharding_fsdp2_reports_per_gpu_memory(capsys):
    args = ["predict", "--profile", "a100-pcie4", "--model", "llama2-13b", "--gpus", "4"]
    assert cli.main(args + ["--json"]) == 0
    ddp = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--json", "--sharding", "fsdp2"]) == 0
    fsdp = json.loads(capsys.readouterr().out)
    for mode in S.MODES:
        assert fsdp[mode]["device_memory_bytes"] < ddp[mode]["device_memory_bytes"]
        if mode == "state-swap":  # the room FSDP2 frees keeps more of the state resident
            assert fsdp[mode]["host_memory_bytes"] < ddp[mode]["host_memory_bytes"]
        else:
            assert fsdp[mode]["host_memory_bytes"] == ddp[mode]["host_memory_bytes"]
    assert cli.main(args + ["--sharding", "fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "4 GPU(s) (fsdp2)" in out and "not modelled" in out
    assert cli.main(args + ["--sharding", "zero3"]) == cli.EXIT_USAGE
    assert "invalid choice: 'zero3'" in capsys.readouterr().err


def test_cli_predict_dense_params_moves_the_embeddings_between_sides(capsys, monkeypatch,
                                                                    tmp_path):
    """The dense set (embed_tokens and lm_head of the preset) costs device memory and saves
    host memory and link bytes; --dense-params with no pattern splits them; the built-in
    profiles (regenerated with the dense set) spell out the library's default set; the
    other modes offload every matrix either way."""
    from zenflow_triton.config import ZenFlowConfig

    pin_profile(monkeypatch, tmp_path)  # a profile with the dense set

    args = ["predict", "--profile", "a100-pcie4", "--model", "llama2-7b", "--json"]
    assert cli.main(args) == 0
    as_profile = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--dense-params", "*embed*", "*LM_HEAD*"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert cli.main(args + ["--dense-params"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert dense["zenflow"]["settings"]["dense_params"] == ["*embed*", "*LM_HEAD*"]
    assert split["zenflow"]["settings"]["dense_params"] == []
    assert as_profile["zenflow"]["settings"]["dense_params"] == \
        list(ZenFlowConfig().dense_params)
    for key in ("device_memory_bytes", "host_memory_bytes", "link_bytes_per_step"):
        assert as_profile["zenflow"][key] == dense["zenflow"][key], key
    assert dense["zenflow"]["device_memory_bytes"] > split["zenflow"]["device_memory_bytes"]
    assert dense["zenflow"]["host_memory_bytes"] < split["zenflow"]["host_memory_bytes"]
    assert dense["zenflow"]["link_bytes_per_step"] < split["zenflow"]["link_bytes_per_step"]
    assert dense["zero-offload"] == split["zero-offload"]


def test_cli_predict_table_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert cli.main(["predict", "--profile", "gh200", "--model", "llama2-13b",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "prediction" in out and "| zenflow |" in out and "| zero-offload |" in out
    assert png.exists()


@pytest.mark.parametrize("argv,names", [
    (["--profile", "a100-pcie4", "--model", "llama-7b"], ["llama2-7b", "opt-350m"]),
    (["--profile", "a100-pcie", "--model", "llama2-7b"], ["a100-pcie4", "gh200"]),
    (["--profile", "cpu", "--model", "llama2-7b"], ["bf16_tensor_tflops_dense"]),
])
def test_cli_predict_bad_names_exit_2_naming_the_choices(argv, names, capsys):
    assert cli.main(["predict", *argv]) == 2
    err = capsys.readouterr().err
    for n in names:
        assert n in err


def test_cli_predict_measure_host_uses_the_measured_rate(capsys, monkeypatch):
    import autotune.detect as H

    args = ["predict", "--profile", "h100-pcie5", "--model", "opt-350m", "--json"]
    assert cli.main(args) == 0
    default = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(H, "measure_host_adam", lambda *a, **k: 1e8)  # 16x slower host
    assert cli.main(args + ["--measure-host"]) == 0
    measured = json.loads(capsys.readouterr().out)
    n = sum(p.numel for p in S.Workload.from_preset("opt-350m").params if p.is_matrix(4096))
    slower = measured["zero-offload"]["step_time_s"] - default["zero-offload"]["step_time_s"]
    assert slower == pytest.approx(n / 1e8 - n / 1.6e9, rel=1e-9)


def test_a_gh200_is_detected_as_gh200_not_h200():
    from autotune.detect import matching_builtin

    assert matching_builtin({"accelerators": [{"name": "NVIDIA GH200 480GB"}]}) == "gh200"
    assert matching_builtin({"accelerators": [{"name": "NVIDIA H200"}]}) == "h200-sxm"


def test_fastlink_table_reproduces_what_a_fast_link_changes():
    """bench/stepmodel_fastlink.py makes docs/stepmodel.md's fast-link table: a faster link
    speeds up the offload modes, and a faster host erodes ZenFlow's lead over the delayed
    update (below 1x at 450 GB/s and 4x the default host rate)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "bench" / "stepmodel_fastlink.py"
    spec = importlib.util.spec_from_file_location("stepmodel_fastlink", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in mod.table(0.1, 4).splitlines()[2:]]
    assert len(rows) == 6
    zero = {(r[0], r[1]): float(r[2]) for r in rows}
    assert zero[("450", "7.2")] < zero[("64", "7.2")] < zero[("32", "7.2")]
    vs_dpu = {(r[0], r[1]): float(r[7].rstrip("x")) for r in rows}
    assert vs_dpu[("32", "7.2")] > 1.0 > vs_dpu[("450", "28.8")]


def test_bf16_host_moments_are_zenflow_s_alone_the_peers_keep_fp32_moments():
    """``host_state_dtype`` is a ZenFlow setting: DeepSpeed's CPU Adam keeps its moments in
    its fp32 master's dtype, and per-layer offload runs torch's AdamW on fp32 host copies,
    so neither peer's host memory shrinks with it (a peer must not fit by ZenFlow's option)."""
    h = S.Hardware.from_profile("rtx4090-pcie4")
    wl = S.Workload.from_preset("llama3-8b", tokens=2048)
    for mode in ("zero-offload", "zero-offload-dpu", "overlapped-offload", "state-swap"):
        fp32 = S.predict(h, wl, mode, topk_ratio=0.01, update_interval=4)
        bf16 = S.predict(h, wl, mode, topk_ratio=0.01, update_interval=4,
                         host_state_dtype="bfloat16")
        assert bf16.memory["host"] == fp32.memory["host"], mode
    fp32 = S.predict(h, wl, "zenflow", topk_ratio=0.01, update_interval=4)
    bf16 = S.predict(h, wl, "zenflow", topk_ratio=0.01, update_interval=4,
                     host_state_dtype="bfloat16")
    assert bf16.host_memory_bytes < fp32.host_memory_bytes


def test_a_zenflow_prediction_over_the_host_names_the_leaner_host_settings():
    """Llama-3-8B on a 128 GB desktop: the note gives each leaner host setting's host GB
    (as its own prediction counts it) and says which fit."""
    base = S.Hardware.from_profile("rtx4090-pcie4")
    h = S.Hardware(**{**base.__dict__, "host_memory_bytes": 128e9})
    wl = S.Workload.from_preset("llama3-8b", tokens=2048)
    cfg = dict(topk_ratio=0.01, update_interval=4, dense_params=(), stream_grads=True)
    p = S.predict(h, wl, "zenflow", **cfg)
    assert p.host_memory_bytes > h.usable_host_bytes
    note = next(n for n in p.notes if n.startswith("leaner host settings: "))
    for changes in (dict(host_state_dtype="bfloat16"), dict(accumulator_dtype="bfloat16"),
                    dict(host_state_dtype="bfloat16", accumulator_dtype="bfloat16")):
        q = S.predict(h, wl, "zenflow", **cfg, **changes)
        named = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        fits = " (fits)" if q.host_memory_bytes <= h.usable_host_bytes else ""
        assert f"{named}: {q.host_memory_bytes / 1e9:.1f} GB{fits}" in note, (named, note)
    assert "accumulate_on" not in note  # streaming sums on the host
    assert "(fits)" in note
