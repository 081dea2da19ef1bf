"""The modelled objective (autotune/modelled/, ``zenflow-tune run --objective modelled``):
quality measured once on a grid and reused by every profile and model, speed from the
step-time model, the fastest feasible point chosen, saved as a loadable profile with its
provenance, and every bad input refused before any training."""

from __future__ import annotations

import functools
import json
import math

import optuna
import pytest
import torch
from optuna.trial import TrialState

from autotune import cli
from autotune import modelled as MD
from autotune.modelled import quality_study as QS  # the quality study trains with these
from autotune import stepmodel as SM
from autotune import study as S
from autotune.objective import TrainResult, TuneSettings
from autotune.training import tiny_lm
from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.profiles import PROFILE_DIR_ENV, ProfileNotFoundError, load_profile

optuna.logging.set_verbosity(optuna.logging.WARNING)

small_lm = functools.partial(tiny_lm, d=64, n_layers=1, n_heads=2, seq_len=32, batch_size=8,
                             heldout_batches=2)
TS = TuneSettings(workload="small", steps=8, skip_steps=2, lr=3e-3, loss_margin=0.05)
GRID = MD.QualityGrid(topk_ratios=(0.01, 0.1, 0.5), update_intervals=(1, 4, 16))


def quiet(msg: str) -> None:
    pass


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(S.DATA_DIR_ENV, str(tmp_path / "data"))
    return tmp_path


def fake_loss(settings: dict) -> float:
    """Quality that gets worse as fewer columns are updated every step and the host window
    grows: the fast settings (small topk, long interval) fail a 5% guard over 1.0."""
    k, ui = settings["topk_ratio"], settings["update_interval"]
    return 1.0 + 0.02 * math.log2(ui) * (0.5 / k) ** 0.5


@pytest.fixture
def fake(monkeypatch):
    """Cheap training: the reference and every grid point return made-up losses; counts the
    runs (a reused quality store must train nothing)."""
    calls = {"train": [], "reference": 0}

    def train(factory, make_optimizer, ts, **kw):
        opt = make_optimizer([torch.nn.Parameter(torch.zeros(64, 64))])
        settings = {k: getattr(opt.config, k) for k in MD.QUALITY_KEYS}
        opt.close()
        calls["train"].append(settings)
        return TrainResult(throughput=1000.0, heldout_loss=fake_loss(settings),
                           final_train_loss=1.0, diverged=False, measured_steps=ts.steps,
                           measured_seconds=1.0, unit="tokens")

    def reference(factory, ts):
        calls["reference"] += 1
        return {"optimizer": "torch.optim.AdamW", "heldout_loss": 1.0, "initial_loss": 2.0,
                "throughput": 1000.0, "unit": "tokens", "steps": ts.steps}

    monkeypatch.setattr(QS, "train_and_measure", train)
    monkeypatch.setattr(QS, "measure_reference", reference)
    return calls


def _run(url, **kw):
    args = dict(profile="a100-pcie4", model="llama2-7b", factory=small_lm, ts=TS, grid=GRID,
                storage_url=url, log=quiet)
    args.update(kw)
    return MD.run_modelled(**args)


# ---- the quality store ---------------------------------------------------------------------
def test_quality_store_is_measured_once_and_reused(dirs, fake):
    url = f"sqlite:///{dirs / 'q.db'}"
    first = _run(url)
    assert first.store.trials_run == len(fake["train"]) == 9 and fake["reference"] == 1
    assert first.store.study_name == MD.quality_study_name(TS)
    # another hardware profile and another model: no training at all
    second = _run(url, profile="h100-pcie5", model="qwen2.5-3b", gpus=2, tokens=8192)
    assert second.store.trials_run == 0
    assert len(fake["train"]) == 9 and fake["reference"] == 1
    assert [(p.settings, p.heldout_loss, p.feasible) for p in second.store.points] == \
        [(p.settings, p.heldout_loss, p.feasible) for p in first.store.points]
    # each point's loss, violation and verdict are kept in the study
    study = optuna.load_study(study_name=first.store.study_name, storage=S.make_storage(url))
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert len(done) == 9
    for t in done:
        assert t.user_attrs["heldout_loss"] == pytest.approx(fake_loss(t.user_attrs["settings"]))
        assert t.user_attrs["quality_violation"] == pytest.approx(
            t.user_attrs["heldout_loss"] - first.store.limit)
        assert t.user_attrs["feasible"] == (t.user_attrs["quality_violation"] <= 0)
    # a larger grid trains only the new points
    bigger = MD.QualityGrid(topk_ratios=(0.01, 0.1, 0.5), update_intervals=(1, 2, 4, 16))
    third = _run(url, grid=bigger)
    assert third.store.trials_run == 3 and len(fake["train"]) == 12
    assert {c["update_interval"] for c in fake["train"][9:]} == {2}
    # another objective (e.g. another loss margin) is another quality study
    other = TuneSettings(**{**TS.to_dict(), "betas": tuple(TS.betas), "loss_margin": 0.1})
    assert MD.quality_study_name(other) != MD.quality_study_name(TS)


def test_an_interrupted_quality_grid_resumes_with_only_the_missing_points(dirs, fake,
                                                                          monkeypatch):
    url = f"sqlite:///{dirs / 'q.db'}"
    inner = QS.train_and_measure

    def interrupted(factory, make_optimizer, ts, **kw):
        if len(fake["train"]) == 4:
            raise KeyboardInterrupt  # like Ctrl-C in the middle of the fifth point
        return inner(factory, make_optimizer, ts, **kw)

    monkeypatch.setattr(QS, "train_and_measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(url)
    assert len(fake["train"]) == 4
    monkeypatch.setattr(QS, "train_and_measure", inner)
    out = _run(url)
    assert out.store.trials_run == 5 and len(fake["train"]) == 9
    keys = [MD.point_key(s) for s in fake["train"]]
    assert len(set(keys)) == 9  # no point trained twice


def test_a_failing_point_is_retried_then_reported(dirs, fake, monkeypatch):
    url = f"sqlite:///{dirs / 'q.db'}"
    inner = QS.train_and_measure
    fails = {"n": 0}

    def flaky(factory, make_optimizer, ts, **kw):
        opt = make_optimizer([torch.nn.Parameter(torch.zeros(64, 64))])
        bad = opt.config.topk_ratio == 0.5 and opt.config.update_interval == 16
        opt.close()
        if bad and fails["n"] < fails.get("limit", 1):
            fails["n"] += 1
            raise RuntimeError("host worker died")
        return inner(factory, make_optimizer, ts, **kw)

    monkeypatch.setattr(QS, "train_and_measure", flaky)
    out = _run(url)  # failed once, trained again, complete
    assert fails["n"] == 1 and len(out.store.points) == 9
    fails.update(n=0, limit=99)
    grid = MD.QualityGrid(topk_ratios=(0.5, 0.3), update_intervals=(16,))
    with pytest.raises(RuntimeError, match="failed 2 times.*host worker died"):
        _run(url, grid=grid, ts=TuneSettings(**{**TS.to_dict(), "betas": tuple(TS.betas),
                                                "seed": 1}))


# ---- the choice ------------------------------------------------------------------------------
def test_the_fastest_feasible_point_by_the_model_is_chosen(dirs, fake):
    out = _run(f"sqlite:///{dirs / 'q.db'}")
    hw, wl = SM.Hardware.from_profile("a100-pcie4"), SM.Workload.from_preset("llama2-7b")
    speed = {}
    for p in out.store.points:
        pred = SM.predict(hw, wl, "zenflow", config=p.settings)
        if not pred.fits:  # a point that fits only with the window summed on the host
            pred = SM.predict(hw, wl, "zenflow", config=dict(p.settings, accumulate_on="host"))
        speed[MD.point_key(p.settings)] = (wl.tokens / pred.modelled_step_time_s, pred.fits)
    fastest = max(speed, key=lambda k: speed[k][0])
    by_key = {MD.point_key(p.settings): p for p in out.store.points}
    assert not by_key[fastest].feasible  # the guard matters: the fastest point fails it
    ok = [k for k, (_, fits) in speed.items() if by_key[k].feasible and fits]
    best = max(ok, key=lambda k: speed[k][0])
    assert MD.point_key(out.best.point.settings) == best
    assert out.best.throughput == pytest.approx(speed[best][0])
    assert out.best.throughput < speed[fastest][0]
    assert [r.throughput for r in out.rows] == sorted((r.throughput for r in out.rows),
                                                      reverse=True)
    table = MD.format_modelled_table(out)
    assert f"{out.best.throughput:,.0f}" in table and "infeasible" in table
    assert "within 5% of AdamW's" in MD.guard_line(out.store)


def test_a_delay_grid_adds_points_and_keeps_the_stored_ones(dirs, fake, monkeypatch):
    """``apply_delays`` adds a point per distinct delay of each update interval (1.0: the
    default schedule, whose key has no delay, so points stored before the delay was searched
    are reused), and the chosen point is ranked by the step model with its delay."""
    grid = MD.QualityGrid(topk_ratios=(0.1,), update_intervals=(1, 4, 16),
                          apply_delays=(1.0, 0.5, 0.25))
    pts = grid.points()
    assert [(p["update_interval"], p["apply_delay"]) for p in pts] == [
        (1, None), (4, None), (4, 2), (4, 1), (16, None), (16, 8), (16, 4)]
    old_style = {k: v for k, v in pts[1].items() if k != "apply_delay"}
    assert MD.point_key(old_style) == MD.point_key(pts[1]) != MD.point_key(pts[2])
    url = f"sqlite:///{dirs / 'q.db'}"
    plain = MD.QualityGrid(topk_ratios=(0.1,), update_intervals=(1, 4, 16))
    _run(url, grid=plain)
    assert len(fake["train"]) == 3
    # a shorter delay costs no quality in this fake: the model decides, by its step time
    out = _run(url, grid=grid)
    assert out.store.trials_run == 4 and len(fake["train"]) == 7
    assert {c["apply_delay"] for c in fake["train"][3:]} == {1, 2, 4, 8}
    hw, wl = SM.Hardware.from_profile("a100-pcie4"), SM.Workload.from_preset("llama2-7b")
    for r in out.rows:
        want = SM.predict(hw, wl, "zenflow", config=r.settings).modelled_step_time_s
        assert r.step_time_s == pytest.approx(want)
        assert r.settings["apply_delay"] == r.point.settings.get("apply_delay")
    # at 0.1 x 4 on a100-pcie4 a delay of 2 costs step time (the host job takes ~3 steps)
    by = {(r.point.settings["update_interval"], r.point.settings.get("apply_delay")): r
          for r in out.rows}
    assert by[4, 2].step_time_s > by[4, None].step_time_s
    assert "delay" in MD.format_modelled_table(out)
    with pytest.raises(MD.ModelledError, match=r"fractions of the update interval in \(0, 1\]"):
        MD.QualityGrid(apply_delays=(0.0,))


def test_a_model_that_does_not_fit_chooses_nothing(dirs, fake):
    # Llama-2-13B's bf16 params alone (26 GB) exceed a 24 GB card
    out = _run(f"sqlite:///{dirs / 'q.db'}", profile="rtx4090-pcie4", model="llama2-13b")
    assert out.best is None and not any(r.fits for r in out.rows)
    assert any("fits" in n and "24 GB" in n for n in out.notes)
    with pytest.raises(MD.ModelledError):
        MD.modelled_profile(out, "nothing")


def test_a_7b_model_on_a_24_gb_card_fits_with_the_gradient_streamed(dirs, fake):
    # the whole bf16 gradient (13.5 GB) beside the params (13.5 GB) never fits 24 GB; streamed
    # off the device during backward it need not be resident, and a lean point fits
    # a host with room: the desktop's 128 GB the profile assumes does not hold Llama-2-7B's
    # host state (test_where_the_host_binds_bf16_moments_are_searched_and_refused_unmeasured)
    roomy = MD.profile_of("rtx4090-pcie4", host_memory_gb=256)
    out = _run(f"sqlite:///{dirs / 'q.db'}", profile=roomy)
    assert out.best is not None, out.notes
    assert out.best.settings.get("stream_grads") is True
    assert out.best.prediction.device_memory_bytes <= 24e9 * (1 - SM.DEVICE_HEADROOM)
    assert all(r.settings.get("stream_grads") for r in out.rows if r.fits)


# ---- the saved profile, through the CLI, with real training runs -------------------------------
def test_cli_modelled_run_saves_a_profile_that_loads_and_reuses_quality(dirs, capsys):
    url = f"sqlite:///{dirs / 'cli.db'}"
    common = ["run", "--objective", "modelled", "--model", "llama2-7b", "--workload",
              "tests.test_modelled:small_lm", "--steps", "8", "--lr", "3e-3",
              "--loss-margin", "0.05", "--topk-grid", "0.05,0.5", "--interval-grid", "1,8",
              "--storage", url]
    assert cli.main(common + ["--profile", "a100-pcie4"]) == 0
    out = capsys.readouterr().out
    assert "AdamW reference held-out loss" in out and "(within 5% of AdamW's)" in out
    assert "rank" in out and "vs zero-off" in out and "(4 run(s) trained now)" in out
    assert "saved profile 'a100-pcie4-llama2-7b'" in out
    prof = load_profile("a100-pcie4-llama2-7b")
    pv = prof.provenance
    assert prof.source == "user" and pv["source"] == "modelled" and pv["measured"] is False
    assert (pv["model"], pv["gpus"], pv["tokens"]) == ("llama2-7b", 1, 4096)
    assert pv["workload"] == "tests.test_modelled:small_lm" and pv["loss_margin"] == 0.05
    assert pv["quality_study"].startswith("quality-") and pv["date"]
    assert pv["hardware_profile"] == "a100-pcie4"
    assert 0 < pv["objective"]["step_time_s"] and 0 <= pv["objective"]["stall_fraction"] <= 1
    assert pv["objective"]["heldout_loss"] <= pv["objective"]["loss_limit"]
    assert "null" in pv["host_adam_source"]  # the GPU profiles have no measured host rate
    assert prof.hardware == load_profile("a100-pcie4").hardware
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    opt = ZenFlowOptimizer.from_profile("a100-pcie4-llama2-7b", model.parameters(), lr=1e-4)
    try:
        for k in MD.QUALITY_KEYS:  # (JSON keeps the dense set's tuple as a list)
            want = prof.settings[k]
            assert getattr(opt.config, k) == (tuple(want) if isinstance(want, list) else want)
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    finally:
        opt.close()
    # a second hardware profile: nothing trained, saved under its own name
    assert cli.main(common + ["--profile", "h100-pcie5", "--save-as", "h100-mine"]) == 0
    out = capsys.readouterr().out
    assert "(0 run(s) trained now)" in out and "Measuring" not in out
    assert load_profile("h100-mine").provenance["quality_study"] == pv["quality_study"]


# ---- bad inputs --------------------------------------------------------------------------------
@pytest.fixture
def no_training(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("trained before the inputs were checked")

    monkeypatch.setattr(QS, "train_and_measure", boom)
    monkeypatch.setattr(QS, "measure_reference", boom)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(model="llama-7b"), MD.ModelledError, "valid presets: .*llama2-7b"),
    (dict(profile="cpu"), MD.ModelledError, "accelerator facts"),
    (dict(profile="a100-pcie"), ProfileNotFoundError, "Did you mean 'a100-pcie4'"),
    (dict(gpus=0), MD.ModelledError, "gpus"),
    (dict(mfu=1.5), MD.ModelledError, "mfu"),
    (dict(grid=MD.QualityGrid(topk_ratios=(1.5,))), MD.ModelledError, "topk_ratio"),
])
def test_bad_inputs_fail_before_any_training(dirs, no_training, kw, exc, match):
    with pytest.raises(exc, match=match):
        _run(f"sqlite:///{dirs / 'q.db'}", **kw)


M = ["run", "--objective", "modelled"]


@pytest.mark.parametrize("argv, message", [
    (M + ["--model", "llama2-7b"], "needs --profile NAME"),
    (M + ["--profile", "a100-pcie4"], "needs --model PRESET"),
    (M, "needs --profile NAME and --model PRESET"),
    (M + ["--profile", "a100-pcie4", "--model", "llama-7b"], "valid presets: llama2-13b"),
    (M + ["--profile", "cpu", "--model", "llama2-7b"], "accelerator facts"),
    (M + ["--profile", "a100-pcie", "--model", "llama2-7b"], "Did you mean 'a100-pcie4'"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--n-trials", "3"],
     "--n-trials: only for --objective measured"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--quick"], "--quick: only"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--topk-grid", "x"],
     "--topk-grid"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--topk-grid", "1.5"],
     "topk_ratio"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--interval-grid", "2.5"],
     "--interval-grid"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--delay-grid", "1,1.5"],
     "fractions of the update interval"),
    (["run", "--delay-grid", "0.5,1.5"],
     "--delay-grid: shares of the update interval are in (0, 1], got 1.5"),
    (["run", "--delay-grid", "half"], "--delay-grid: expected comma-separated numbers"),
    (["run", "--betas-grid", "step,windows"],
     "--betas-grid: host_betas values to search are ['step', 'window'], got"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--betas-grid", "adam"],
     "host_betas values to search are ['step', 'window']"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--save-as", "Bad/Name"],
     "invalid profile name"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--mfu", "2"], "--mfu"),
    (["run", "--model", "llama2-7b"], "--model: only with --objective modelled"),
    (["run", "--gpus", "2"], "--gpus: only with --objective modelled"),
    (["run", "--profile", "a", "--save-as", "b"], "give one"),
    (M + ["--profile", "a100-pcie4", "--model", "llama2-7b", "--objective", "guessed"],
     "invalid choice"),
])
def test_cli_bad_combinations_exit_1_with_a_clear_message(argv, message, dirs, no_training,
                                                         capsys):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "--help)" in err and len(err.strip().splitlines()) <= 3


def test_default_quality_settings_are_the_tuners_defaults():
    from autotune.training import DEFAULT_WORKLOAD

    factory, ts = MD.default_quality_settings()
    d = TuneSettings()
    assert ts.workload == DEFAULT_WORKLOAD and ts.device == "cpu"
    assert (ts.lr, ts.steps, ts.loss_margin, ts.seed) == (d.lr, d.steps, d.loss_margin, d.seed)
    from zenflow_triton import ZenFlowConfig
    from zenflow_triton.config import DEFAULT_SELECT_INTERVAL_WINDOWS

    pts = MD.QualityGrid().points()
    assert len(pts) == 35
    assert all(p["host_lr_scale"] == ZenFlowConfig().host_lr_scale and p["overlap"] is True
               and p["select_interval"] == DEFAULT_SELECT_INTERVAL_WINDOWS * p["update_interval"]
               for p in pts)
    assert MD.default_save_name("a100-pcie4", "llama2-7b", 1, None) == "a100-pcie4-llama2-7b"
    assert MD.default_save_name("gh200", "qwen2.5-3b", 4, 8192) == "gh200-qwen2.5-3b-4gpu-8192tok"
    # the user's own model: a config.json (or its folder) by the folder, a factory by name
    for spec in ("/models/llama3/config.json", "/models/llama3", "models/llama3/"):
        assert MD.default_save_name("a100-pcie4-40gb", spec, 1, None) == \
            "a100-pcie4-40gb-llama3", spec
    assert MD.default_save_name("h100-sxm5", "mine.models:build", 1, None) == "h100-sxm5-build"
    json.dumps(MD.QualityGrid().points())  # JSON-able: they are stored as study keys


# ---- the built-in profiles (bench/regenerate_profiles.py) ---------------------------------------
@pytest.mark.parametrize("name", ["a100-pcie4", "a100-sxm4", "h100-pcie5", "h100-sxm5",
                                  "h200-sxm", "gh200", "l40s-pcie4", "rtx4090-pcie4"])
def test_builtin_gpu_profiles_record_what_the_model_gives_for_their_settings(name, dirs):
    """A built-in GPU profile's recorded step time and stall are the step-time model's for
    its settings today: if this fails, the model changed, so rerun
    ``python bench/regenerate_profiles.py`` (the quality grid is stored: no training)."""
    prof = load_profile(name)
    pv = prof.provenance
    assert pv["source"] == "modelled" and pv["hardware_profile"] == name
    hw = SM.Hardware.from_profile(prof)
    wl = SM.Workload.from_preset(pv["model"], tokens=pv["tokens"], mfu=pv["mfu"])
    p = SM.predict(hw, wl, "zenflow", gpus=pv["gpus"], config=dict(prof.settings))
    zo = SM.predict(hw, wl, "zero-offload", gpus=pv["gpus"], config=dict(prof.settings))
    obj = pv["objective"]
    assert p.fits
    assert p.modelled_step_time_s == pytest.approx(obj["step_time_s"], rel=1e-9)
    assert p.stall_fraction == pytest.approx(obj["stall_fraction"], rel=1e-9, abs=1e-12)
    assert zo.modelled_step_time_s == pytest.approx(obj["zero_offload_step_time_s"], rel=1e-9)
    assert obj["tokens_per_s_per_gpu"] == pytest.approx(wl.tokens / p.modelled_step_time_s)


def test_a_point_that_fits_only_with_host_accumulation_takes_it(dirs, fake):
    """An A100 40 GB and Llama-2-7B: no point fits with the window summed on the device
    (58+ GB), each one does on the host (same quality on the fp32 quality workload), so the
    chosen profile sums on the host. Llama-3-8B needs more than the grid searches: the note
    names what would fit."""
    forty = MD.profile_of("a100-pcie4", 40)
    out = _run(f"sqlite:///{dirs / 'q.db'}", profile=forty)
    windows = [r for r in out.rows if r.settings["update_interval"] > 1  # (1: no accumulator)
               and r.fits]
    assert windows and all(r.settings.get("accumulate_on") == "host" for r in windows)
    on_device = [SM.predict(out.hardware, out.workload, "zenflow",
                            config=dict(r.settings, accumulate_on="device", stream_grads=False))
                 for r in windows]
    assert not any(p.fits for p in on_device)
    assert out.best is not None and out.best.prediction.device_memory_bytes <= 40e9
    # Llama-3-8B on 40 GB: only with the gradient streamed off the device
    big = _run(f"sqlite:///{dirs / 'q.db'}", profile=forty, model="llama3-8b", lean=False)
    assert big.best is not None and big.best.settings.get("stream_grads") is True
    # on 32 GB not even so, without the lean points (searched by default where nothing else
    # fits: the next tests); the note names what would fit
    small = _run(f"sqlite:///{dirs / 'q.db'}", profile=MD.profile_of("a100-pcie4", 32),
                 model="llama3-8b", lean=False)
    assert small.best is None
    # the note names leaner settings that the model says would fit (the streamed gradient)
    assert any("stream_grads=True" in n and "would fit" in n for n in small.notes), small.notes


# ---- memory: the lean variant of each point ---------------------------------------------------
def _lean(settings: dict) -> bool:
    return all(settings.get(k) == v for k, v in MD.LEAN_POINT.items())


def test_lean_points_are_trained_only_where_nothing_plain_fits_and_only_those_that_fit(
        dirs, fake):
    url = f"sqlite:///{dirs / 'q.db'}"
    roomy = _run(url, model="llama3-8b")  # 80 GB: the dense set fits
    assert not any(_lean(s) for s in fake["train"]) and roomy.best is not None
    assert not any(_lean(r.point.settings) for r in roomy.rows)
    # 32 GB: the dense set (its AdamW state on the device) leaves no room, even with the
    # gradient streamed
    card = MD.profile_of("a100-pcie4", 32)
    out = _run(url, profile=card, model="llama3-8b", save_as="a40-l3")
    lean_rows = [r for r in out.rows if _lean(r.point.settings)]
    assert lean_rows and all(r.fits for r in lean_rows)  # only those that fit were trained
    assert not any(r.fits for r in out.rows if not _lean(r.point.settings))
    assert len(fake["train"]) == 9 + len(lean_rows)
    assert out.best is not None and _lean(out.best.settings)
    assert out.best.prediction.device_memory_bytes <= 32e9
    saved = load_profile("a40-l3").settings
    assert saved["dense_params"] == [] or saved["dense_params"] == ()
    assert saved["accumulator_dtype"] == "bfloat16"
    if saved["update_interval"] > 1:
        assert saved["accumulate_on"] == "host"
    table = MD.format_modelled_table(out)
    assert "memory side" in table and "lean" in table


def test_lean_can_be_forced_or_refused(dirs, fake):
    url = f"sqlite:///{dirs / 'q.db'}"
    out = _run(url, lean=True)
    assert sum(_lean(s) for s in fake["train"]) == 9 == sum(_lean(r.point.settings)
                                                               for r in out.rows)
    card = MD.profile_of("a100-pcie4", 40)
    none = _run(url, profile=card, model="llama3-8b", lean=False)
    assert none.best is None or not _lean(none.best.settings)


def test_point_keys_keep_their_old_form_with_an_fp32_accumulator():
    plain = MD.QualityGrid(topk_ratios=(0.1,), update_intervals=(4,)).points()[0]
    assert "accumulator_dtype" not in json.loads(MD.point_key(plain))
    lean = dict(plain, **MD.LEAN_POINT)
    assert json.loads(MD.point_key(lean))["accumulator_dtype"] == "bfloat16"
    assert MD.point_key(lean) != MD.point_key(plain)


def test_point_keys_name_window_betas_and_keep_the_old_form_without():
    plain = MD.QualityGrid(topk_ratios=(0.1,), update_intervals=(4,)).points()[0]
    assert plain["host_betas"] == "step" and "host_betas" not in json.loads(MD.point_key(plain))
    window = dict(plain, host_betas="window")
    assert json.loads(MD.point_key(window))["host_betas"] == "window"
    assert MD.point_key(window) != MD.point_key(plain)


def test_a_betas_grid_adds_window_points_above_interval_one(dirs, fake):
    grid = MD.QualityGrid(topk_ratios=(0.1,), update_intervals=(1, 4),
                          apply_delays=(1.0, 0.25), host_betas=("step", "window"))
    pts = [(p["update_interval"], p["host_betas"], p["apply_delay"]) for p in grid.points()]
    assert pts == [(1, "step", None), (4, "step", None), (4, "step", 1), (4, "window", None),
                   (4, "window", 1)]
    assert len({MD.point_key(p) for p in grid.points()}) == len(pts)
    with pytest.raises(MD.ModelledError, match="host_betas values to search"):
        MD.QualityGrid(host_betas=("none",))
    # each point trains with its own betas, and the progress lines, the table and the
    # provenance say which
    lines = []
    out = _run(f"sqlite:///{dirs / 'q.db'}", grid=grid, log=lines.append)
    progress = [ln.split(":")[0] for ln in lines if ln.startswith("quality point")]
    assert len(progress) == len(set(progress)) == len(pts), progress
    assert "quality point topk_ratio=0.1 update_interval=4 apply_delay=1 host_betas=window" \
        in progress
    assert [c.get("host_betas", "step") for c in fake["train"]] == [p[1] for p in pts]
    assert "betas" in MD.format_modelled_table(out, top=len(pts))
    assert MD.modelled_provenance(out)["grid"]["host_betas"] == ["step", "window"]


@pytest.mark.parametrize("profile,model,gpus,sharding", [
    ("a100-pcie4", "llama3-8b", 2, "ddp"), ("a100-pcie4", "llama3-8b", 2, "fsdp2"),
    ("a100-pcie4", "llama3-8b", 1, "fsdp2"), ("rtx4090-pcie4", "llama2-7b", 2, "ddp")])
def test_the_tuner_never_ranks_or_saves_streaming_where_the_optimizer_refuses_it(
        dirs, profile, model, gpus, sharding):
    """Streaming is refused under DDP and FSDP2 (``StreamingError`` at construction): on one
    GPU the pick streams (Llama-3-8B on 40 GB, Llama-2-7B on an RTX 4090), on more
    ranks or FSDP2 no eligible row and no saved profile does."""
    # the RTX 4090 in a host with room (the desktop's 128 GB does not hold Llama-2-7B's)
    card = (MD.profile_of(profile, 40) if profile == "a100-pcie4"
            else MD.profile_of(profile, host_memory_gb=256))
    one = MD.run_modelled(profile=card, model=model, quality="real", log=quiet)
    assert one.best is not None and one.best.settings.get("stream_grads") is True
    out = MD.run_modelled(profile=card, model=model, gpus=gpus, sharding=sharding,
                          quality="real", save_as="many", log=quiet)
    assert not [r.settings for r in out.rows if r.eligible and r.settings.get("stream_grads")]
    if out.best is None:
        with pytest.raises(ProfileNotFoundError):
            load_profile("many")
        # nothing fits but what the optimizer refuses, or what fits failed the quality bar
        assert any("refuses" in n or "failed the quality bar" in n for n in out.notes), \
            out.notes
    else:
        assert not load_profile("many").settings.get("stream_grads")


def test_where_the_host_binds_the_measured_bf16_moment_class_is_picked_and_pinned(dirs):
    """Llama-3-8B on a 24 GB card in a 128 GB desktop: with fp32 host moments no measured
    setting fits the host. A class the store measured with bf16 host moments is a point of its
    own, judged by its own rows: the tuner ranks it with those moments (so its host memory
    is what fits), picks it, and the saved profile pins them. The bf16 variant of any other
    class is unmeasured: the quality gate (whose key holds host_state_dtype) refuses it."""
    from autotune.realquality import load_store, setting_key
    store = load_store()
    bf16 = [e for e in store.entries.values()
            if e["settings"].get("host_state_dtype") == "bfloat16"
            and store.verdict(e["settings"]).passed]
    assert bf16, "the store has no passing class with bf16 host moments"
    prof = MD.profile_of("rtx4090-pcie4", host_memory_gb=128)
    out = MD.run_modelled(profile=prof, model="llama3-8b", quality="real", loss="chunked",
                          save_as="desk", log=quiet)
    assert out.best is not None
    assert out.best.settings["host_state_dtype"] == "bfloat16"
    assert out.best.point.verdict.passed
    assert setting_key(out.best.point.settings) in {setting_key(e["settings"]) for e in bf16}
    hw = out.hardware
    assert out.best.prediction.host_memory_bytes <= hw.usable_host_bytes
    fp32 = SM.predict_fitting(hw, out.workload, "zenflow",
                              config=dict(out.best.settings, host_state_dtype="float32"))
    assert fp32.host_memory_bytes > hw.usable_host_bytes  # what the bf16 moments buy
    assert load_profile("desk").settings["host_state_dtype"] == "bfloat16"
    classes = {setting_key(e["settings"]) for e in store.entries.values()}
    for entry in store.entries.values():
        if entry["settings"].get("host_state_dtype") == "bfloat16":
            continue
        point = dict(entry["settings"], host_state_dtype="bfloat16")
        assert setting_key(point) != setting_key(entry["settings"])
        if setting_key(point) in classes:  # measured as a class of its own: judged by its rows
            continue
        verdict = store.verdict(point)
        assert not verdict.measured and not verdict.passed


def test_a_base_profile_s_bf16_moments_do_not_carry_over_to_points_measured_without_them():
    """Ranking over a base profile that holds bf16 host moments (a desktop profile saved
    earlier): each point is predicted, and would be saved, with the host moments its quality
    was measured with, so an fp32-measured point cannot fit the host by the base's moments."""
    store = MD.real_quality_store(None, "tuned")
    hw = SM.Hardware.from_profile(MD.profile_of("rtx4090-pcie4", host_memory_gb=128))
    wl = SM.Workload.from_preset("llama3-8b", tokens=4096).replace(loss="chunked")
    rows = MD.rank_points(store, hw, wl, base_settings={"host_state_dtype": "bfloat16"})
    assert {r.settings["host_state_dtype"] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert r.settings["host_state_dtype"] == r.point.settings.get("host_state_dtype",
                                                                      "float32")
        assert r.prediction.settings["host_state_dtype"] == r.settings["host_state_dtype"]
    assert all(r.settings["host_state_dtype"] == "bfloat16" for r in rows if r.eligible)


def test_where_no_zenflow_setting_qualifies_the_tuner_names_what_to_run_instead(tmp_path,
                                                                                monkeypatch):
    """Llama-3-8B on a 24 GB card in a 128 GB desktop, held to the defaults' bar: no measured
    setting that fits the host passes it, so the verdict names the fastest peer that fits
    and the software that runs it; every peer mode the tuner may name has such a line."""
    from autotune.modelled.outcome import PEER_SOFTWARE
    assert set(PEER_SOFTWARE) == set(MD.PEER_MODES)
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    out = MD.run_modelled(profile=MD.profile_of("rtx4090-pcie4", host_memory_gb=128),
                          model="llama3-8b", quality="real", loss="chunked", bar="default",
                          log=lambda s: None)
    assert out.best is None
    fastest = MD.fastest_peer(out)
    assert fastest is not None
    from autotune.modelled.report import peer_lines
    text = "\n".join(peer_lines(out))
    assert f"use {fastest[1]}" in text and PEER_SOFTWARE[fastest[1]] in text
