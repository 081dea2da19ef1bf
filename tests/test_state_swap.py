"""The state-swap mode of the step model (Adam state in pinned host memory, streamed through
the device for an exact AdamW step every step, a share resident): its degenerate cases, its
link bound, its memory, the resident share that fits, and its calibration rows."""

import dataclasses

import pytest

from autotune import stepmodel as S
from autotune.stepmodel.inputs import STATE_SWAP_CHUNK_ELEMENTS
from autotune.stepmodel.report import STATE_SWAP_SOURCES, state_swap_calibration

HW = S.Hardware.from_profile("a100-pcie4")
WL = S.Workload.from_preset("llama2-7b", tokens=4096)
UNLIMITED = dataclasses.replace(HW, device_memory_bytes=None)


def _offloaded(wl):  # the elements every mode but adamw offloads
    return sum(p.numel for p in wl.params if p.is_matrix(4096))


def test_all_resident_is_adamw():
    swap = S.predict(UNLIMITED, WL, "state-swap", resident_fraction=1.0)
    adamw = S.predict(UNLIMITED, WL, "adamw")
    assert swap.modelled_step_time_s == pytest.approx(adamw.modelled_step_time_s, rel=1e-12)
    assert swap.link_bytes_per_step == 0.0 and swap.host_memory_bytes == 0
    assert swap.device_memory_bytes == pytest.approx(adamw.device_memory_bytes, rel=1e-9)


def test_zero_link_time_is_adamw_whatever_the_resident_share():
    instant = UNLIMITED.with_link(1e30)
    adamw = S.predict(instant, WL, "adamw").modelled_step_time_s
    for r in (0.0, 0.3, 1.0):
        swap = S.predict(instant, WL, "state-swap", resident_fraction=r)
        assert swap.modelled_step_time_s == pytest.approx(adamw, rel=1e-9)


@pytest.mark.parametrize("r", [0.0, 0.25, 0.5])
def test_a_slow_link_bounds_the_step_by_the_state_moved(r):
    slow = UNLIMITED.with_link(1e9)  # 1 GB/s each way, no contention
    p = S.predict(slow, WL, "state-swap", resident_fraction=r)
    moved = _offloaded(WL) * (1 - r) * 12  # fp32 master, m, v of a bf16 param
    assert p.link_up_bytes_per_step == pytest.approx(moved) == p.link_down_bytes_per_step
    one_way = moved / slow.link_bandwidth
    assert one_way <= p.modelled_step_time_s
    # two streaming buffers: a step hides at most two chunks' up-copies behind compute
    fwd_bwd = S.predict(slow, WL, "adamw").modelled_step_time_s
    assert p.modelled_step_time_s <= one_way + fwd_bwd + 1e-9
    assert p.host_busy_fraction == 0.0  # the host only holds the state


def test_memory_and_the_resident_share_that_fits():
    forty = dataclasses.replace(HW, device_memory_bytes=40e9)
    r = S.resident_that_fits(forty, WL)
    assert 0.0 < r < 1.0
    fits = S.predict(forty, WL, "state-swap", resident_fraction=r)
    more = S.predict(forty, WL, "state-swap", resident_fraction=r + 0.01)
    assert fits.fits and not more.fits
    assert S.predict(forty, WL, "state-swap").notes[0].startswith(f"{r:.0%} of the Adam state")
    none = S.predict(forty, WL, "state-swap", resident_fraction=0.0)
    # params and gradients, the small params' state and two buffers of at most a chunk
    pg = 2 * WL.numel * 2 + sum(S.activation_bytes(WL).values())  # and the activations
    assert pg < none.device_memory_bytes <= pg + 2 * STATE_SWAP_CHUNK_ELEMENTS * 12 + \
        (WL.numel - _offloaded(WL)) * 12
    assert none.host_memory_bytes == pytest.approx(_offloaded(WL) * 12)
    assert S.resident_that_fits(UNLIMITED, WL) == 1.0
    tiny = dataclasses.replace(HW, device_memory_bytes=1e9)
    assert S.resident_that_fits(tiny, WL) == 0.0
    assert not S.predict(tiny, WL, "state-swap").fits


def test_a_resident_share_out_of_range_is_refused():
    with pytest.raises(S.StepModelError, match="resident_fraction"):
        S.predict(HW, WL, "state-swap", resident_fraction=1.5)


def test_calibration_rows_compare_ratios_to_the_same_setup_without_offload():
    rows = state_swap_calibration()
    want = sum(len(s["runs"]) + bool(s["zero_offload"]) + bool(s["memory_gib"])
               for s in STATE_SWAP_SOURCES)
    assert len(rows) == want
    for r in rows:
        assert r["rel_error"] == pytest.approx((r["model_ratio"] - r["published_ratio"])
                                               / r["published_ratio"])
    # more offloaded is never faster, in the model as in the measurements
    nemo = [r for r in rows if "NeMo" in r["source"] and r["case"].startswith("state-swap")]
    assert nemo[0]["model_ratio"] <= nemo[1]["model_ratio"]
    assert nemo[0]["published_ratio"] <= nemo[1]["published_ratio"]
