"""Hardware profiles: built-ins, user profiles winning over them, and every bad-input path."""

from __future__ import annotations

import json
import re

import pytest
import torch

from zenflow_triton import ConfigError, ZenFlowConfig, ZenFlowOptimizer
from zenflow_triton import profiles as P

BUILTINS = ["a100-pcie4", "a100-sxm4", "h100-pcie5", "h100-sxm5", "h200-sxm", "gh200",
            "l40s-pcie4", "rtx4090-pcie4", "rtx3090-pcie4", "cpu"]
HOST_LINK_GB_S = {"PCIe Gen4 x16": 64, "PCIe Gen5 x16": 128, "NVLink-C2C": 900}
"""Datasheet host-link bandwidth, both directions together: PCIe Gen4 x16 = 64 GB/s, Gen5 x16
= 128 GB/s, NVLink-C2C (GH200's Grace-Hopper link) = 900 GB/s."""


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "profiles"
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(d))
    return d


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8))


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_profiles_are_valid_and_cited(name):
    prof = P.load_profile(name)
    assert prof.name == name and prof.source == "builtin"
    assert prof.schema_version == P.SCHEMA_VERSION
    assert prof.path == P.builtin_profile_dir() / f"{name}.json"
    cfg = prof.config()
    assert isinstance(cfg, ZenFlowConfig)
    # Not measured on that hardware: the provenance must say so and cite the paper whose
    # defaults they replace (or, for cpu, still are).
    pv = prof.provenance
    assert pv["measured"] is False
    assert any("2505.12242" in c["url"] for c in pv["citations"])
    hw = prof.hardware
    if name == "cpu":  # no accelerator facts to model: the paper defaults
        assert pv["source"] == "paper-defaults"
        assert (cfg.topk_ratio, cfg.update_interval) == (0.1, 4)
        return
    # GPU profiles: chosen by the modelled objective (bench/regenerate_profiles.py)
    from autotune.modelled import QUALITY_TOPK_RATIOS, QUALITY_UPDATE_INTERVALS
    from autotune.stepmodel import PRESETS
    from zenflow_triton.config import DEFAULT_SELECT_INTERVAL_WINDOWS

    assert pv["source"] == "modelled"
    for key in ("model", "gpus", "tokens", "date"):
        assert pv.get(key) not in (None, ""), key
    assert pv["model"] in PRESETS and (pv["gpus"], pv["tokens"]) == (1, 4096)
    assert pv["model"] == "llama2-7b" or pv["fallback"].startswith("llama2-7b: does not fit")
    # quality from real pretrained models (autotune/data/real_quality.json), named with the
    # seeds, and every core workload within the bar the profile records
    from autotune.realquality import BARS, load_store
    q = pv["quality"]
    assert q["source"] == "real models" and q["bar"] in BARS and {0, 1} <= set(q["seeds"])
    assert "SmolLM2-135M-Instruct" in q["models"] and "all-MiniLM-L6-v2" in q["models"]
    verdict = load_store().verdict(dict(prof.settings), q["bar"])
    assert verdict.passed and verdict.name == q["setting_class"]
    assert set(q["workloads"]) == {r.workload for r in verdict.results}
    obj = pv["objective"]
    assert obj["step_time_s"] > 0 and 0 <= obj["stall_fraction"] <= 1
    assert obj["speedup_vs_zero_offload"] > 1
    if hw.get("host_adam_elements_per_s") is None:  # the model's default host rate, said so
        assert "null" in pv["host_adam_source"]
    assert cfg.topk_ratio in QUALITY_TOPK_RATIOS
    assert cfg.update_interval in QUALITY_UPDATE_INTERVALS
    assert cfg.select_interval == DEFAULT_SELECT_INTERVAL_WINDOWS * cfg.update_interval
    for key in ("link_bandwidth_gb_s", "memory_bandwidth_gb_s", "bf16_tensor_tflops_dense",
                "fp32_tflops"):
        assert isinstance(hw[key], (int, float)) and hw[key] > 0, key
    assert hw["citation"]["url"].startswith("https://")
    # the link is the host link (CPU-GPU), not the GPU-GPU NVLink
    assert hw["link_bandwidth_gb_s"] == HOST_LINK_GB_S[hw["host_link"]]
    if "link_bandwidth_per_direction_gb_s" in hw:
        assert hw["link_bandwidth_per_direction_gb_s"] * 2 == hw["link_bandwidth_gb_s"]
    _check_link_measurements(hw)


LINK_FIELDS = ("link_h2d_gb_s", "link_d2h_gb_s", "link_h2d_while_d2h_gb_s",
               "link_d2h_while_h2d_gb_s")


def _check_link_measurements(hw: dict) -> None:
    """Each measured link figure of a built-in GPU profile is cited (NVIDIA's nvbandwidth
    issues); a figure with no public measurement is null and says so; no measured figure
    beats the datasheet, and a contended one is no faster than its direction alone."""
    cited = {m["field"]: m for m in hw["link_measurements"]}
    assert set(cited) == set(LINK_FIELDS)
    for key in LINK_FIELDS:
        value, m = hw[key], cited[key]
        assert m["value"] == value and m["what"], key
        if value is None:
            assert "no public measurement" in m["what"] and m["sources"] == [], key
            continue
        assert 0 < value <= hw["link_bandwidth_per_direction_gb_s"], key
        assert m["sources"] and all(
            re.fullmatch(r"https://github\.com/NVIDIA/nvbandwidth/issues/\d+", c["url"])
            and c["title"] == "NVIDIA/nvbandwidth issue #" + c["url"].rsplit("/", 1)[1]
            for c in m["sources"]), key
    for both, alone in (("link_h2d_while_d2h_gb_s", "link_h2d_gb_s"),
                        ("link_d2h_while_h2d_gb_s", "link_d2h_gb_s")):
        if hw[both] is not None:
            assert hw[both] <= hw[alone]


def test_builtin_facts_are_ordered_as_the_datasheets_say():
    bw = {n: P.load_profile(n).hardware["memory_bandwidth_gb_s"] for n in BUILTINS if n != "cpu"}
    assert bw["h200-sxm"] > bw["h100-sxm5"] > bw["a100-sxm4"] > bw["a100-pcie4"] > bw["l40s-pcie4"]
    assert bw["h200-sxm"] > bw["gh200"] > bw["h100-sxm5"]  # 4.8 > 4.0 (96 GB HBM3) > 3.35 TB/s
    assert bw["h100-sxm5"] > bw["h100-pcie5"]


def test_list_profiles_has_all_builtins():
    names = [p.name for p in P.list_profiles()]
    assert set(BUILTINS) <= set(names)
    assert names == sorted(names)


def test_from_profile_builds_optimizer_with_profile_settings_and_overrides():
    model = _model()
    opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.parameters(), lr=2e-5,
                                        update_interval=2, weight_decay=0.0)
    try:
        assert opt.config.update_interval == 2          # override wins
        assert opt.config.topk_ratio == P.load_profile("a100-pcie4").settings["topk_ratio"]
        assert opt.param_groups[0]["lr"] == 2e-5
        assert opt.param_groups[0]["weight_decay"] == 0.0
    finally:
        opt.close()


def test_invalid_override_fails_naming_the_field():
    with pytest.raises(ConfigError, match="update_interval"):
        ZenFlowOptimizer.from_profile("cpu", _model().parameters(), update_interval=0)
    with pytest.raises(ConfigError, match="select_interval"):
        P.load_profile("cpu").config(update_interval=4, select_interval=6)
    with pytest.raises((ConfigError, TypeError), match="no_such_field"):
        ZenFlowOptimizer.from_profile("cpu", _model().parameters(), no_such_field=1)


def test_unknown_name_lists_known_and_closest():
    with pytest.raises(P.ProfileNotFoundError) as ei:
        P.load_profile("h100-sxm")
    e = ei.value
    assert e.closest == "h100-sxm5"
    msg = str(e)
    assert "Did you mean 'h100-sxm5'?" in msg
    for n in BUILTINS:
        assert n in msg
    with pytest.raises(P.ProfileNotFoundError):
        ZenFlowOptimizer.from_profile("a100_pcie", _model().parameters())
    # names that could escape the directory are just unknown names
    with pytest.raises(P.ProfileNotFoundError):
        P.load_profile("../cpu")


def _save(name="mine", **settings):
    prof = P.Profile(name=name, settings=settings or {"topk_ratio": 0.25, "update_interval": 2},
                     hardware={"device": "test"}, provenance={"source": "measured"})
    return P.save_profile(prof)


def test_save_then_load_round_trip_and_user_wins_over_builtin(user_dir):
    path = _save("mine", topk_ratio=0.25, update_interval=2, select_interval=8)
    assert path == user_dir / "mine.json"
    got = P.load_profile("mine")
    assert got.source == "user" and got.path == path
    assert got.config().select_interval == 8
    # a user profile named like a built-in shadows it
    _save("cpu", topk_ratio=0.3, update_interval=8)
    assert P.load_profile("cpu").source == "user"
    assert P.load_profile("cpu").settings["update_interval"] == 8
    assert [p.source for p in P.list_profiles() if p.name == "cpu"] == ["user"]
    opt = ZenFlowOptimizer.from_profile("cpu", _model().parameters())
    try:
        assert opt.config.update_interval == 8 and opt.config.topk_ratio == 0.3
    finally:
        opt.close()
    # no temp files left behind
    assert sorted(p.name for p in user_dir.iterdir()) == ["cpu.json", "mine.json"]


def test_user_profile_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert P.user_profile_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(P.PROFILE_DIR_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    if P.sys.platform.startswith("linux"):
        assert P.user_profile_dir() == tmp_path / "xdg" / "zenflow-triton" / "profiles"


def test_corrupt_json_names_the_file(user_dir):
    user_dir.mkdir(parents=True)
    bad = user_dir / "broken.json"
    bad.write_text('{"schema_version": 1, "name": "broken",')
    with pytest.raises(P.ProfileError) as ei:
        P.load_profile("broken")
    assert str(bad) in str(ei.value) and "not valid JSON" in str(ei.value)
    assert not isinstance(ei.value, P.ProfileNotFoundError)
    # list_profiles can report it without dying
    profiles, errors = P.list_profiles(errors="collect")
    assert "broken" not in [p.name for p in profiles] and len(errors) == 1
    assert str(bad) in str(errors[0])
    with pytest.raises(P.ProfileError):
        P.list_profiles()


def _write(user_dir, name, doc):
    user_dir.mkdir(parents=True, exist_ok=True)
    p = user_dir / f"{name}.json"
    p.write_text(json.dumps(doc))
    return p


def _doc(name="x", **over):
    d = {"schema_version": 1, "name": name, "hardware": {}, "settings": {"topk_ratio": 0.2},
         "provenance": {"source": "measured"}}
    d.update(over)
    return d


def test_newer_schema_version_fails_clearly(user_dir):
    p = _write(user_dir, "future", _doc("future", schema_version=P.SCHEMA_VERSION + 1))
    with pytest.raises(P.ProfileError) as ei:
        P.load_profile("future")
    msg = str(ei.value)
    assert str(p) in msg and "newer" in msg and "upgrade" in msg
    assert re.search(rf"schema_version {P.SCHEMA_VERSION + 1}\b", msg)


@pytest.mark.parametrize("doc, problem", [
    (_doc("w", settings={"topk_ratio": 1.5}), "topk_ratio"),
    (_doc("w", settings={"update_interval": 4, "select_interval": 6}), "select_interval"),
    (_doc("w", settings={"bogus": 1}), "bogus"),
    (_doc("w", settings=[1, 2]), "'settings' must be a JSON object"),
    (_doc("w", schema_version="1"), "schema_version must be a positive integer"),
    (_doc("w", provenance={"source": "made-up"}), "provenance.source"),
    (_doc("other-name"), "declares name 'other-name'"),
    ({"name": "w"}, "missing required key"),
    ([1, 2, 3], "expected a JSON object"),
])
def test_wrong_schema_fails_naming_file_and_problem(user_dir, doc, problem):
    p = _write(user_dir, "w", doc)
    with pytest.raises(P.ProfileError) as ei:
        P.load_profile("w")
    assert str(p) in str(ei.value)
    assert problem in str(ei.value)


def test_save_rejects_bad_names_and_bad_settings(user_dir):
    with pytest.raises(P.ProfileError, match="invalid profile name"):
        P.Profile(name="../evil", settings={}, provenance={"source": "measured"})
    with pytest.raises(P.ProfileError, match="update_interval"):
        P.Profile(name="ok", settings={"update_interval": 0}, provenance={"source": "measured"})
    assert not user_dir.exists()
