"""``zenflow-tune measure`` (autotune/measure.py): the step model's speed inputs measured on
this machine. On a CPU-only machine it measures the host AdamW rate, says the link needs a
GPU and saves a profile the model reads the rate from; its arithmetic and the profile it
writes from a link measurement are checked here; the link measurement itself runs where
CUDA is (the last test)."""

from __future__ import annotations

import json

import pytest
import torch

from autotune import cli
from autotune import measure as ME
from autotune import stepmodel as S
from autotune.detect import host_adam_times
from zenflow_triton import profiles as P

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):  # profiles are saved here, not in the user's folder
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    return tmp_path / "profiles"


# ---- the arithmetic -----------------------------------------------------------------------
def test_gb_per_s_is_1e9_bytes_per_second():
    assert ME.gb_per_s(128 * 2**20, 0.005) == pytest.approx(26.8435456, rel=1e-12)
    assert ME.gb_per_s(25e9, 1.0) == 25.0
    with pytest.raises(ValueError, match="seconds must be > 0"):
        ME.gb_per_s(1, 0.0)


def test_median_of_timings():
    assert ME.median([3.0, 1.0, 2.0]) == 2.0
    assert ME.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert ME.median([0.7]) == 0.7
    with pytest.raises(ValueError, match="no values"):
        ME.median([])
    with pytest.raises(ValueError, match="finite and > 0"):
        ME.median([1.0, 0.0])


def test_repeats_fill_the_budget_within_bounds():
    assert ME.repeats_for(1.0, 0.1) == 10
    assert ME.repeats_for(0.01, 0.1) == ME.MIN_REPEATS
    assert ME.repeats_for(100.0, 0.001) == ME.MAX_REPEATS
    assert ME.repeats_for(1.0, 0.0) == ME.MAX_REPEATS


def test_host_adam_times_stop_at_the_budget_after_three():
    times = host_adam_times(1 << 12, 40, threads=1, seconds=1e-9)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert len(host_adam_times(1 << 12, 2, threads=1, seconds=1e-9)) == 2


# ---- the command on this machine ------------------------------------------------------------
def test_measure_prints_the_host_rate_and_saves_it_in_a_profile(capsys):
    assert cli.main(["measure", "--seconds", "0.3", "--profile", "a100-pcie4",
                     "--save-as", "here", "--json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert "wrote" in captured.err and "here.json" in captured.err
    rate = got["host"]["elements_per_s_all_cores"]
    assert rate > 0 and got["host"]["elements_per_s_per_core"] > 0
    prof = P.load_profile("here")
    hw = prof.hardware
    assert hw["host_adam_elements_per_s"] == rate
    assert hw["host_adam_elements_per_s_per_core"] == got["host"]["elements_per_s_per_core"]
    assert hw["host_cores"] == got["host"]["cores"]
    block = prof.provenance["inputs_measured"]
    assert block["base_profile"] == "a100-pcie4" and block["date"] == got["date"]
    assert "host_adam_elements_per_s" in block["measured"]
    assert block["machine"]["host"]["usable_cpus"] == got["host"]["cores"]
    assert prof.settings == P.load_profile("a100-pcie4").settings  # not re-tuned
    model = S.Hardware.from_profile("here")
    assert model.host_rate(1) == rate  # the step model uses the measured rate
    if HAS_CUDA:
        assert got["link"]["measured"] and hw["link_h2d_gb_s"] == got["link"]["link_h2d_gb_s"]
    else:
        assert got["link"] == {"measured": False, "why": ME.NO_GPU}
        assert "link_measurements" in hw and hw["link_h2d_gb_s"] == 25.0  # the base's


def test_measure_says_plainly_that_the_link_needs_a_gpu(capsys):
    assert cli.main(["measure", "--seconds", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "host AdamW" in out and "M elements/s" in out and "all " in out
    if not HAS_CUDA:
        assert "link: not measured: measuring the host-device link needs a CUDA GPU" in out
        assert "profile 'cpu' assumes" not in out  # no --profile, no --save-as: no base


@pytest.mark.parametrize("argv,names", [
    (["--profile", "a100-pcie", "--save-as", "x"], ["--profile 'a100-pcie'", "a100-pcie4"]),
    (["--profile", "nowhere/mine.json"], ["--profile 'nowhere/mine.json'", "cannot read"]),
    (["--save-as", "Bad Name", "--profile", "cpu"], ["--save-as", "invalid profile name"]),
    (["--seconds", "0"], ["--seconds", "must be > 0"]),
])
def test_bad_options_are_usage_errors_naming_them_before_anything_is_measured(
        argv, names, capsys, monkeypatch):
    def measured(*a, **k):
        raise AssertionError("measured despite a bad option")

    monkeypatch.setattr(ME, "measure", measured)
    assert cli.main(["measure", *argv]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    for n in names:
        assert n in err


# ---- the profile from a link measurement ------------------------------------------------------
def _link_measurement() -> dict:
    return {
        "date": "2026-12-06T00:00:00+00:00",
        "machine": {"host": {"cpu": "test", "usable_cpus": 32},
                    "accelerators": [{"name": "GPU A"}, {"name": "GPU A"}],
                    "matching_profile": None},
        "versions": {"torch": torch.__version__},
        "host": {"numel": 1 << 24, "cores": 32, "elements_per_s_all_cores": 3.2e9,
                 "elements_per_s_per_core": 2e8, "measured_with": {"threads": 32}},
        "link": {"measured": True, "device": "GPU A", "bytes": 1 << 27, "method": "test",
                 "link_h2d_gb_s": 24.0, "link_d2h_gb_s": 26.0,
                 "link_h2d_while_d2h_gb_s": 13.0, "link_d2h_while_h2d_gb_s": 20.0},
    }


def test_a_link_measurement_becomes_the_models_link():
    base = P.load_profile("h100-pcie5")
    prof = ME.measured_profile(base, "mine", _link_measurement(), "zenflow-tune measure")
    P.save_profile(prof)
    hw = S.Hardware.from_profile("mine")
    assert (hw.h2d, hw.d2h, hw.h2d_while_d2h, hw.d2h_while_h2d) == (24e9, 26e9, 13e9, 20e9)
    assert hw.link_contention() == {"link-up": 13 / 24, "link-down": 20 / 26}
    assert hw.host_adam_elements_per_s == 3.2e9 and hw.host_cores == 32
    assert hw.accelerators_per_node == 2 and hw.host_rate(2) == 1.6e9
    assert hw.device_flops == S.Hardware.from_profile(base).device_flops  # base facts kept
    saved = P.load_profile("mine")
    block = saved.provenance["inputs_measured"]
    assert set(ME.LINK_FIGURES) <= set(block["measured"])
    assert block["detected"] == {"accelerators_per_node": 2}
    assert all(m["sources"][0]["title"] == "this machine"
               for m in saved.hardware["link_measurements"])
    assert saved.provenance["source"] == base.provenance["source"]  # the settings' origin


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_measure_link_on_a_gpu():
    got = ME.measure_link(0.2, nbytes=1 << 24)
    for key in ME.LINK_FIGURES:
        assert got[key] > 0, key
    assert got["link_h2d_while_d2h_gb_s"] <= got["link_h2d_gb_s"] * 1.2
    assert isinstance(got["other_way_busy_throughout_h2d_while_d2h"], bool)
