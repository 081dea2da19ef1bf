"""The real-model quality store (autotune/realquality.py, autotune/data/real_quality.json) and
the modelled tuner that reads it: the store is what the convergence study's rows say, a
setting passes only where it was measured and stayed within the bar on every workload, an
unmeasured setting is left out (never interpolated), and a pick is printed beside the peers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autotune import cli
from autotune import modelled as MD
from autotune import realquality as RQ
from zenflow_triton.profiles import PROFILE_DIR_ENV, describe, load_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path / "data"))
    return tmp_path


def test_the_shipped_store_is_what_the_study_rows_say():
    """Rebuilt from bench/convergence/data by bench/convergence/quality_store.py, the store
    equals the shipped one (dates and commits aside): no figure in it is typed by hand."""
    r = subprocess.run([sys.executable, "bench/convergence/quality_store.py", "--check"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "up to date" in r.stdout


def test_the_shipped_store_loads_with_provenance_and_its_core_measured():
    store = RQ.load_store()
    pv = store.provenance
    assert pv["commit"] and pv["date"] and "quality_store.py" in pv["command"]
    assert pv["sources"] and all(s["file"].startswith("bench/convergence/data/")
                                 for s in pv["sources"])
    assert {"smollm2", "minilm"} <= set(store.core)
    kinds = {store.workloads[w]["kind"] for w in store.core}
    assert kinds == {"lm", "classification"}
    # the library's defaults are measured on every core workload at 2 seeds
    from zenflow_triton.config import ZenFlowConfig
    v = store.verdict({}, "tuned")
    assert v.measured and not v.missing and v.name == "zenflow-adaptive-dense"
    assert all(len(r.seeds) >= 2 for r in v.results if r.workload in store.core)
    assert ZenFlowConfig().topk_ratio == 0.1  # (what {} stands for)


def _store(tmp_path, entries, core=("lm1", "cls1")) -> Path:
    doc = {"format": RQ.FORMAT,
           "provenance": {"date": "2026-12-06", "commit": "abc", "seeds": [0, 1]},
           "core": list(core),
           "workloads": {"lm1": {"model": "M1", "kind": "lm", "task": "t"},
                         "cls1": {"model": "M2", "kind": "classification", "task": "t"},
                         "cls2": {"model": "M2", "kind": "classification", "task": "t"}},
           "entries": entries}
    path = tmp_path / "store.json"
    path.write_text(json.dumps(doc))
    return path


def _entry(name, settings, **results):
    """A class's rows, run as the study runs them (``fresh_if_spread`` off unless said)."""
    return {"name": name, "settings": dict({"fresh_if_spread": False}, **settings),
            "results": {w: dict({"seeds": [0, 1]}, **r) for w, r in results.items()}}


def _off(settings):
    """``settings`` as the study ran them: no switch on a spread gradient."""
    return dict(settings, fresh_if_spread=False)


def test_verdicts_pass_fail_and_unmeasured_by_the_bar(tmp_path):
    path = _store(tmp_path, [
        _entry("ok", {}, lm1=dict(loss_delta=0.004), cls1=dict(loss_delta=0.009,
                                                                accuracy_delta_pts=-0.4)),
        _entry("acc", {"topk_ratio": 0.02, "update_interval": 8},
               lm1=dict(loss_delta=0.0), cls1=dict(loss_delta=0.0, accuracy_delta_pts=-1.6)),
        _entry("lm", {"topk_ratio": 0.05}, lm1=dict(loss_delta=0.016),
               cls1=dict(loss_delta=-0.01, accuracy_delta_pts=0.5)),
        _entry("half", {"topk_ratio": 0.2}, lm1=dict(loss_delta=0.0)),
        _entry("extra", {"topk_ratio": 0.3}, lm1=dict(loss_delta=0.0),
               cls1=dict(loss_delta=0.0, accuracy_delta_pts=0.0),
               cls2=dict(loss_delta=0.05, accuracy_delta_pts=0.0)),
    ])
    store = RQ.load_store(path)
    ok = store.verdict(_off({"topk_ratio": 0.1, "update_interval": 4, "select_interval": 64}))
    assert ok.measured and ok.passed and "passed on 2" in ok.summary()
    assert store.verdict(_off({}), "default").passed  # +0.009 <= 0.01, -0.4 >= -0.5
    acc = store.verdict(_off({"topk_ratio": 0.02, "update_interval": 8}), "tuned")
    assert acc.measured and not acc.passed and "accuracy -1.6 pts < -1.5" in acc.failed[0].why
    lm = store.verdict(_off({"topk_ratio": 0.05}))
    assert not lm.passed and lm.failed[0].workload == "lm1"
    assert store.verdict(_off({"topk_ratio": 0.05}), "default").failed[0].why.startswith("loss")
    half = store.verdict(_off({"topk_ratio": 0.2}))
    assert not half.measured and not half.passed and half.missing == ("cls1",)
    assert "not measured" in half.summary()
    # a workload beyond the core counts against a setting measured on it
    extra = store.verdict(_off({"topk_ratio": 0.3}))
    assert extra.measured and not extra.passed and extra.failed[0].workload == "cls2"
    # a divergence fails the setting on that workload; it is never "not measured"
    div = _store(tmp_path, [dict(_entry("div", {}, cls1=dict(loss_delta=0.0,
                                                               accuracy_delta_pts=0.0)),
                                 results={"cls1": {"seeds": [0, 1], "loss_delta": 0.0},
                                          "lm1": {"seeds": [0, 1], "diverged": 1,
                                                  "loss_delta": None}})])
    d = RQ.load_store(div).verdict(_off({}))
    assert d.measured and not d.passed and "diverged on 1 seed(s)" in d.failed[0].why
    never = store.verdict(_off({"topk_ratio": 0.5}))
    assert not never.measured and never.name is None
    with pytest.raises(RQ.RealStoreError, match="unknown quality bar 'loose'"):
        store.verdict(_off({}), "loose")


def test_setting_keys_name_the_arithmetic_not_the_spelling():
    key = RQ.setting_key
    assert key({}) == key({"topk_ratio": 0.1, "update_interval": 4, "select_interval": 64,
                           "host_lr_scale": "adaptive"})
    # an apply_delay given (even the default's) is never switched by fresh_if_spread
    assert key({"apply_delay": 4}) == key({"fresh_if_spread": False}) != key({})
    assert key({"accumulate_on": "host", "stream_grads": True}) == key({})  # same arithmetic
    assert key({"dense_params": []}) == key({"dense_params": ()}) != key({})
    assert key({"apply_delay": 1}) != key({})
    assert key({"host_betas": "window"}) != key({})
    assert key({"overlap": False}) != key({})


@pytest.mark.parametrize("text, match", [
    ("{", "not readable JSON"),
    ('{"format": 1}', "format 1"),
    ('{"format": 2, "core": ["x"], "workloads": {}, "entries": []}', "not described"),
    ('{"format": 2, "core": [], "workloads": {"w": {"kind": "lm", "model": "m", "task": "t"}}, '
     '"entries": [{"name": "n", "settings": {}, "results": {"v": {"loss_delta": 0, '
     '"seeds": [0]}}}]}', "unknown workload 'v'"),
    ('{"format": 2, "core": [], "workloads": {"w": {"kind": "lm", "model": "m", "task": "t"}}, '
     '"entries": [{"name": "n", "settings": {}, "results": {"w": {"seeds": [0]}}}]}',
     "malformed"),
    ('{"format": 2, "core": [], "workloads": {"w": {"kind": "lm", "model": "m", "task": "t"}}, '
     '"entries": [{"name": "n", "settings": {}, "results": {"w": {"seeds": [0], '
     '"loss_delta": "x"}}}]}', "loss_delta must be a finite number"),
    ('{"format": 2, "core": [], "workloads": {"w": {"kind": "lm", "model": "m", "task": "t"}}, '
     '"entries": [{"name": "a", "settings": {}, "results": {}}, '
     '{"name": "b", "settings": {"topk_ratio": 0.1}, "results": {}}]}', "are one setting"),
])
def test_a_corrupt_store_names_the_file_and_the_problem(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(RQ.RealStoreError, match=match) as e:
        RQ.load_store(path)
    assert str(path) in str(e.value)
    with pytest.raises(RQ.RealStoreError, match="no such file"):
        RQ.load_store(tmp_path / "missing.json")


def test_the_40gb_a100_llama3_8b_run_saves_a_windowed_setting_from_real_models(dirs, capsys):
    """The run of issue 48 (it saved nothing on the tiny LM's verdict): from the real-model
    store it saves a setting with a window that fits, and names the workloads it passed on."""
    argv = ["run", "--objective", "modelled", "--profile", "a100-pcie4", "--device-memory-gb",
            "40", "--model", "llama3-8b", "--save-as", "mine"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "quality from the real-model store" in out and "nothing trained" in out
    assert "beside the peers" in out and "zero-offload-dpu" in out
    prof = load_profile("mine")
    assert prof.settings["update_interval"] > 1
    q = prof.provenance["quality"]
    assert q["source"] == "real models" and q["bar"] == "tuned"
    assert set(q["workloads"]) >= set(RQ.load_store().core)
    assert "SmolLM2-135M-Instruct" in q["models"] and q["seeds"] == [0, 1]
    assert "passed on" in q["summary"]
    text = describe(prof)
    assert "quality: real models: passed on" in text and "seeds 0, 1" in text


def test_points_the_store_lacks_are_left_out_and_said(dirs):
    grid = MD.QualityGrid(topk_ratios=(0.1, 0.3), update_intervals=(4,))
    lines = []
    out = MD.run_modelled(profile="a100-pcie4", model="llama2-7b", quality="real", grid=grid,
                          log=lines.append)
    assert [r.point.settings["topk_ratio"] for r in out.rows] == [0.1]
    assert [p["topk_ratio"] for p in out.store.real.unmeasured] == [0.3]
    assert any("1 point(s) asked for are not measured" in m for m in lines)
    assert "1 asked for but not measured: left out" in MD.format_modelled_table(out)


def test_a_faster_peer_is_named_with_its_margin(dirs):
    """A small model on a big card: AdamW fits and its step is shorter than any offload; the
    report says so plainly instead of only the speed-up over ZeRO-Offload."""
    out = MD.run_modelled(profile="h100-sxm5", model="qwen3-0.6b", quality="real", log=print)
    assert out.best is not None and out.peers["adamw"].fits
    text = "\n".join(MD.peer_lines(out))
    t_pick, t_adamw = out.best.step_time_s, out.peers["adamw"].modelled_step_time_s
    assert t_adamw < t_pick
    assert f"adamw is faster than the pick by {t_pick / t_adamw - 1:.0%}" in text


def test_run_takes_sharding_like_predict(dirs, capsys):
    base = ["run", "--objective", "modelled", "--profile", "h200-sxm", "--model", "llama3-70b",
            "--gpus", "8", "--no-profile"]
    code = cli.main(base + ["--sharding", "fsdp2"])
    out = capsys.readouterr().out
    assert "(8 GPU(s), fsdp2," in out and "(fsdp2)" in out
    fsdp = MD.run_modelled(profile="h200-sxm", model="llama3-70b", gpus=8, sharding="fsdp2",
                           quality="real", log=lambda m: None)
    ddp = MD.run_modelled(profile="h200-sxm", model="llama3-70b", gpus=8, quality="real",
                          log=lambda m: None)
    # fsdp2 holds 1/8 of the params, gradients and state per GPU: less memory at every point
    by_key = {RQ.setting_key(r.point.settings): r for r in ddp.rows}
    assert len(fsdp.rows) > 1  # (ddp may add the lean settings: nothing else fits there)
    for a in fsdp.rows:
        b = by_key[RQ.setting_key(a.point.settings)]
        assert a.prediction.device_memory_bytes < b.prediction.device_memory_bytes
    assert code == (0 if fsdp.best is not None else 2)
    assert cli.main(["run", "--sharding", "fsdp2"]) == 1
    assert "--sharding: only with --objective modelled" in capsys.readouterr().err


def test_the_tiny_lm_verdict_says_it_is_a_demo(dirs, capsys, monkeypatch):
    """``--quality workload`` without a workload of the user's trains the embedded tiny LM and
    says that its verdict is a demo; the grid is kept tiny here."""
    calls = {}

    def fake_run(**kw):
        calls.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(MD, "run_modelled", fake_run)
    with pytest.raises(SystemExit):
        cli.main(["run", "--objective", "modelled", "--profile", "a100-pcie4", "--model",
                  "llama2-7b", "--quality", "workload", "--no-profile"])
    assert "a fast demo of the tuner, not a verdict" in capsys.readouterr().out
    assert calls["quality"] == "workload"


def test_a_profile_setting_the_store_never_ran_is_not_judged_by_it(dirs):
    """Settings outside the grid that change the arithmetic are part of a point's identity: a
    base profile with bf16 host moments is judged only by the classes that ran with them (each
    such point says so), and a base with a warmup no row ran with leaves every entry
    unmeasured."""
    plain = MD.real_quality_store(None, "tuned")
    odd = MD.real_quality_store(None, "tuned", base={"host_state_dtype": "bfloat16"})
    assert plain.points and len(odd.points) < len(plain.points)
    assert all(p.settings.get("host_state_dtype") == "bfloat16" for p in odd.points)
    assert not MD.real_quality_store(None, "tuned", base={"warmup_steps": 7}).points


def test_lean_no_leaves_the_lean_settings_out(dirs):
    store = MD.real_quality_store(None, "tuned", lean=False)
    assert store.points and not any(MD.is_lean(p.settings) for p in store.points)
    assert any(MD.is_lean(p.settings) for p in MD.real_quality_store(None, "tuned").points)


@pytest.mark.parametrize("extra, message", [
    (["--quality", "real", "--workload", "m:f"], "--workload: the real-model store judges"),
    (["--quality", "workload", "--quality-bar", "default"], "--quality-bar: only with"),
])
def test_quality_options_that_would_be_ignored_are_refused(extra, message, dirs, capsys):
    argv = ["run", "--objective", "modelled", "--profile", "a100-pcie4", "--model",
            "llama2-7b", "--no-profile"] + extra
    assert cli.main(argv) == 1
    assert message in capsys.readouterr().err


# ---- fresh_if_spread: a setting that switches on a spread gradient -----------------------------
STALE = {"topk_ratio": 0.1, "update_interval": 4}
FRESH = dict(STALE, host_betas="window", apply_delay=1)
GOOD = dict(lm1=dict(loss_delta=0.001), cls1=dict(loss_delta=0.001, accuracy_delta_pts=0.0))
BAD = dict(lm1=dict(loss_delta=0.001), cls1=dict(loss_delta=0.001, accuracy_delta_pts=-3.0))


def test_setting_keys_name_fresh_if_spread_where_it_can_switch():
    key = RQ.setting_key
    assert key(STALE) != key(_off(STALE))  # the default switches on a spread gradient
    assert key(dict(STALE, fresh_if_spread=True)) == key(STALE)
    # where it cannot switch (a fresh schedule, a window of one, an apply_delay given,
    # no overlap) it is moot
    for moot in (FRESH, dict(STALE, update_interval=1), dict(STALE, apply_delay=2),
                 dict(STALE, overlap=False)):
        assert key(moot) == key(_off(moot)), moot
    assert RQ.switched(STALE) == dict(FRESH, fresh_if_spread=False)
    assert RQ.switched(_off(STALE)) is None and RQ.switched(FRESH) is None


@pytest.mark.parametrize("fresh_rows, own_rows, passes", [
    (GOOD, None, True), (None, None, False), (BAD, None, False), (GOOD, BAD, False)],
    ids=["both-passed", "fresh-unmeasured", "fresh-failed", "own-rows-failed"])
def test_a_switching_setting_passes_only_where_both_schedules_passed(tmp_path, fresh_rows,
                                                                     own_rows, passes):
    entries = [_entry("stale", STALE, **GOOD)]
    if fresh_rows:
        entries.append(_entry("fresh", FRESH, **fresh_rows))
    if own_rows:
        entries.append(_entry("switching", dict(STALE, fresh_if_spread=True), **own_rows))
    store = RQ.load_store(_store(tmp_path, entries))
    assert store.verdict(_off(STALE)).passed  # the schedule as given, alone
    v = store.verdict(STALE)
    assert v.passed is passes
    assert v.measured is (fresh_rows is not None)
    assert v.trains == {"concentrated": "stale", "spread": "fresh" if fresh_rows else None}
    if not passes:
        assert "on a spread gradient" in v.summary() or "own rows failed" in v.summary()
    # the tuner: the point as the default runs where that passed, else pinned off
    point = next(p for p in MD.real_quality_store(None, "tuned", path=store.path).points
                 if p.settings["topk_ratio"] == 0.1 and p.settings["host_betas"] == "step")
    assert point.feasible
    assert point.settings.get("fresh_if_spread", True) is passes
    trains = point.verdict.trains
    assert trains["spread"] == ("fresh" if passes else "stale")


def test_study_rows_are_keyed_as_they_ran(tmp_path, monkeypatch):
    """The study's rows ran with fresh_if_spread off unless their setting turns it on: the
    defaults' rows (zenflow-defaults-fresh-if-spread) and the stale default's
    (zenflow-adaptive-dense) are two classes, not one."""
    sys.path.insert(0, str(ROOT / "bench" / "convergence"))
    import quality_store as QS

    rows = []
    for opt, loss in (("adamw", 1.0), ("zenflow-adaptive-dense", 1.01),
                      ("zenflow-defaults-fresh-if-spread", 1.02)):
        for seed in (0, 1):
            rows.append({"workload": "smollm2", "optimizer": opt, "seed": seed,
                         "final": {"loss": loss}})
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    monkeypatch.setattr(QS, "ROOT", tmp_path)  # (provenance names files under it)
    doc = QS.build([src])
    by_name = {e["name"]: e for e in doc["entries"]}
    assert set(by_name) == {"zenflow-adaptive-dense", "zenflow-defaults-fresh-if-spread"}
    assert by_name["zenflow-adaptive-dense"]["settings"]["fresh_if_spread"] is False
    assert by_name["zenflow-defaults-fresh-if-spread"]["settings"]["fresh_if_spread"] is True
    assert len({RQ.setting_key(e["settings"]) for e in doc["entries"]}) == 2


def test_every_built_in_profile_trains_what_its_quality_claim_measured():
    """A built-in GPU profile's settings, as from_profile trains them (fresh_if_spread's
    default included), pass on the shipped store, on a spread and a concentrated gradient,
    and its provenance names the class it trains on each."""
    from zenflow_triton.profiles import builtin_profile_dir

    store = RQ.load_store()
    for path in sorted(builtin_profile_dir().glob("*.json")):
        prof = load_profile(path.stem)
        if prof.provenance.get("source") != "modelled":
            continue
        v = store.verdict(prof.settings, prof.provenance["quality"]["bar"])
        assert v.passed, (prof.name, v.summary())
        named = prof.provenance["quality"]["trains"]
        assert named == {"on a concentrated gradient": v.trains["concentrated"],
                         "on a spread gradient": v.trains["spread"]}, prof.name


def test_one_seed_on_a_core_workload_is_not_measured(tmp_path):
    one = _entry("one", {}, **GOOD)
    one["results"]["cls1"]["seeds"] = [0]
    store = RQ.load_store(_store(tmp_path, [one]))
    v = store.verdict(_off({}))
    assert not v.measured and not v.passed and v.missing == ("cls1",)
    assert not MD.real_quality_store(None, "tuned", path=store.path).points


def test_a_point_that_failed_is_never_picked_though_measured(dirs):
    """The pick on h100-sxm5 with Llama-2-7B passed the bar on every workload, judged here
    from the store's own figures; every eligible row passed."""
    out = MD.run_modelled(profile="h100-sxm5", model="llama2-7b", quality="real",
                          log=lambda m: None)
    limits = RQ.BARS["tuned"]
    store = out.store.real.store
    assert any(r.point.verdict.measured and not r.point.verdict.passed and r.fits
               for r in out.rows)  # (something measured that failed would fit)
    for row in [r for r in out.rows if r.eligible]:
        v = row.point.verdict
        for res in v.results + (v.spread.results if v.spread else ()):
            kind = store.workloads[res.workload]["kind"]
            assert res.loss_delta <= limits[kind]["loss"], (row.point.verdict.name, res)
            if res.accuracy_delta_pts is not None:
                assert res.accuracy_delta_pts >= limits[kind]["accuracy_pts"], res
