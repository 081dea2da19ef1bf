"""Study runner: Optuna RDB storage (SQLite by default), resume after a kill, the AdamW
reference, pruning of clearly slow trials, and turning the best feasible trial into a profile.

Resume semantics: ``n_trials`` is the number of *finished* (complete or pruned) trials the
study should hold. Rerunning the same command after a kill runs only the missing ones.
A trial whose process died stays RUNNING in the database until its heartbeat is older than
``grace_period``; then the next process to start a trial (or this module at start-up) marks
it FAIL. Several processes on one study cooperate: each asks Optuna for new trials, and
``MaxTrialsCallback`` stops them all once the study holds ``n_trials`` finished trials.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from zenflow_triton.profiles import Profile, platform_dir, save_profile

from .detect import detect, host_adam_settings, measure_host_adam, versions
from .objective import (Objective, TuneSettings, constraints_func,
                        is_feasible, measure_reference)
from .space import SearchSpace, delay_steps

__all__ = ["DATA_DIR_ENV", "data_dir", "default_storage_url", "make_storage", "open_study",
           "SlowTrialPruner", "StudyMismatchError", "run_study", "feasible_trials",
           "profile_from_study", "format_table", "RunOutcome"]

DATA_DIR_ENV = "ZENFLOW_DATA_DIR"
HEARTBEAT_INTERVAL = 5
GRACE_PERIOD = 15
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class StudyMismatchError(ValueError):
    """The study exists with a different objective (workload, steps, lr, seed, loss_margin...)."""


def data_dir() -> Path:
    """``$ZENFLOW_DATA_DIR``, else zenflow-triton's per-user data folder
    (``~/.local/share/zenflow-triton`` on Linux; see ``profiles.platform_dir``)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return platform_dir("data")


def default_storage_url() -> str:
    return f"sqlite:///{data_dir() / 'studies.db'}"


def make_storage(url: str | None = None, *, heartbeat_interval: int = HEARTBEAT_INTERVAL,
                 grace_period: int = GRACE_PERIOD) -> optuna.storages.RDBStorage:
    """RDB storage with heartbeats (so a killed trial becomes FAIL, not RUNNING forever)."""
    url = url or default_storage_url()
    engine_kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        # Several processes on one SQLite file: wait for the write lock instead of failing.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    # Several processes starting on one new database race to create its schema; the loser
    # gets an IntegrityError/OperationalError and simply retries once the winner is done.
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(6):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                if url.startswith("sqlite:///"):
                    return _SQLiteStorage(url, lock_path=Path(str(path) + ".lock"),
                                          engine_kwargs=engine_kwargs,
                                          heartbeat_interval=heartbeat_interval,
                                          grace_period=grace_period)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
                                                  heartbeat_interval=heartbeat_interval,
                                                  grace_period=grace_period)
        except (IntegrityError, OperationalError):
            if attempt == 5:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


class _SQLiteStorage(optuna.storages.RDBStorage):
    """RDB storage on SQLite whose WAITING -> RUNNING transition is serialised across
    processes. Optuna takes an enqueued trial by reading it as WAITING and then marking it
    RUNNING; on PostgreSQL the read locks the row (SELECT ... FOR UPDATE), but SQLite has no
    row locks, so two processes started together could both take the same enqueued trial
    and the second to finish failed with "Cannot tell a COMPLETE trial". A lock file next to
    the database makes the read and the write one step: the second process then sees the
    trial RUNNING and takes another. The lock is held for one statement; the wait for it is
    bounded (LOCK_WAIT_S), after which the transition runs unlocked, as Optuna's own does."""

    LOCK_WAIT_S = 60.0

    def __init__(self, url: str, *, lock_path: Path, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._lock_path = lock_path

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        if state != TrialState.RUNNING:
            return super().set_trial_state_values(trial_id, state, values)
        try:
            import fcntl
        except ImportError:  # not a POSIX system: Optuna's own (racy) transition
            return super().set_trial_state_values(trial_id, state, values)
        with open(self._lock_path, "a") as lock:
            deadline = time.monotonic() + self.LOCK_WAIT_S
            locked = False
            while not locked:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            try:
                return super().set_trial_state_values(trial_id, state, values)
            finally:
                if locked:
                    fcntl.flock(lock, fcntl.LOCK_UN)


def redact_url(url: str) -> str:
    """Hide a password in a SQLAlchemy URL before printing or saving it."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


class SlowTrialPruner(optuna.pruners.BasePruner):
    """Prune a trial whose intermediate throughput is below ``ratio`` x the best *feasible*
    completed trial's throughput (clearly slow: it cannot become the best)."""

    def __init__(self, ratio: float = 0.5):
        if not 0 < ratio < 1:
            raise ValueError(f"ratio must be in (0, 1), got {ratio}")
        self.ratio = ratio

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        value = trial.intermediate_values[step]
        best = best_feasible_value(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        return best is not None and value < self.ratio * best


def feasible_trials(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Completed feasible trials, best (highest throughput) first."""
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
          and is_feasible(t)]
    return sorted(ok, key=lambda t: t.value, reverse=True)


def best_feasible_value(trials: Sequence[FrozenTrial]) -> float | None:
    ft = feasible_trials(trials)
    return ft[0].value if ft else None


def make_sampler(seed: int | None, n_startup: int) -> optuna.samplers.BaseSampler:
    kwargs: dict[str, Any] = dict(seed=seed, n_startup_trials=n_startup, multivariate=True)
    if not hasattr(optuna.trial.Trial, "set_constraint"):  # optuna < 5
        kwargs["constraints_func"] = constraints_func
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(**kwargs)


def fail_stale(study: optuna.Study) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def other_studies(storage_url: str | None, prefix: str, current: str) -> list[str]:
    """Names of the studies in the storage that start with ``prefix`` but are not ``current``
    (the same workload, keyed by other code); [] when the storage cannot be read."""
    try:
        names = optuna.study.get_all_study_names(storage=make_storage(storage_url))
    except Exception:
        return []
    return sorted(n for n in names if n.startswith(prefix + "-") and n != current)


def open_study(name: str, storage: optuna.storages.BaseStorage, *, create: bool = True,
               sampler: optuna.samplers.BaseSampler | None = None,
               pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    if create:
        return optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                   sampler=sampler, pruner=pruner, load_if_exists=True)
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)


def check_or_store_objective(study: optuna.Study, ts: TuneSettings,
                             explicit: set[str] | None = None) -> TuneSettings:
    """First process stores ``ts``; later ones must match in every field they set explicitly
    (fields they did not set are taken from the study)."""
    stored = study.user_attrs.get("objective")
    if stored is None:
        study.set_user_attr("objective", ts.to_dict())
        return ts
    if "tolerance" in stored:
        raise StudyMismatchError(
            f"study {study.study_name!r} was created by an older zenflow-tune whose quality "
            f"guard kept a fraction of AdamW's loss reduction (tolerance="
            f"{stored['tolerance']}); today's guard is a margin over AdamW's loss "
            "(--loss-margin), so its trials are not comparable. Choose a new --study name.")
    stored_ts = TuneSettings.from_dict(stored)
    explicit = set(ts.to_dict()) if explicit is None else explicit
    mine, theirs = ts.to_dict(), stored_ts.to_dict()
    diff = {k: (theirs[k], mine[k]) for k in explicit if k in mine and mine[k] != theirs[k]}
    if diff:
        detail = ", ".join(f"{k}: study has {a!r}, you gave {b!r}" for k, (a, b) in diff.items())
        raise StudyMismatchError(
            f"study {study.study_name!r} was created with a different objective ({detail}); "
            "its trials would not be comparable. Drop those options to resume it, or choose a "
            "new --study name.")
    return stored_ts


@dataclass
class RunOutcome:
    study: optuna.Study
    settings: TuneSettings
    reference: dict[str, Any]
    best: FrozenTrial | None
    profile: Profile | None
    profile_path: Path | None
    trials_run: int


def run_study(*, study_name: str, factory: Callable[..., Any], ts: TuneSettings,
              space: SearchSpace, n_trials: int, storage_url: str | None = None,
              timeout: float | None = None, deadline: float | None = None, explicit: set[str] | None = None,
              profile_name: str | None = None, profile_dir: str | os.PathLike[str] | None = None,
              prune_ratio: float = 0.5, report_every: int = 10, sampler_seed: int | None = 0,
              heartbeat_interval: int = HEARTBEAT_INTERVAL, grace_period: int = GRACE_PERIOD,
              max_consecutive_failures: int = 3,
              log: Callable[[str], None] = print,
              progress: Callable[[optuna.Study, FrozenTrial], None] | None = None,
              on_start: Callable[[int, int], None] | None = None) -> RunOutcome:
    """Create or resume ``study_name`` and run it until it holds ``n_trials`` finished
    trials (or ``timeout`` seconds of trials pass, or ``deadline`` (``time.monotonic()``)
    is reached: no trial starts after it); save the best feasible trial as a profile. A
    study this call created is deleted again when the call fails before any trial finished:
    a failed run leaves no empty study behind."""
    storage = make_storage(storage_url, heartbeat_interval=heartbeat_interval,
                           grace_period=grace_period)
    existed = study_name in optuna.study.get_all_study_names(storage=storage)
    try:
        return _run_study(storage, study_name=study_name, factory=factory, ts=ts, space=space,
                          n_trials=n_trials, storage_url=storage_url, timeout=timeout,
                          deadline=deadline, explicit=explicit, profile_name=profile_name,
                          profile_dir=profile_dir, prune_ratio=prune_ratio,
                          report_every=report_every, sampler_seed=sampler_seed,
                          max_consecutive_failures=max_consecutive_failures, log=log,
                          progress=progress, on_start=on_start)
    except BaseException:
        if not existed:
            try:
                done = [t for t in optuna.load_study(study_name=study_name, storage=storage)
                        .get_trials(deepcopy=False) if t.state.is_finished()
                        and t.state != TrialState.FAIL]
                if not done:
                    optuna.delete_study(study_name=study_name, storage=storage)
            except Exception:  # never hide the original error
                pass
        raise


def _run_study(storage, *, study_name, factory, ts, space, n_trials, storage_url, timeout,
               deadline, explicit, profile_name, profile_dir, prune_ratio, report_every,
               sampler_seed, max_consecutive_failures, log, progress, on_start) -> RunOutcome:
    # A sampler seeded by the number of trials already there: a resumed study does not
    # replay the random start-up suggestions it already tried.
    probe = open_study(study_name, storage)
    fail_stale(probe)
    ts = check_or_store_objective(probe, ts, explicit)
    existing = len(probe.get_trials(deepcopy=False))
    n_startup = max(3, min(10, n_trials // 3))
    seed = None if sampler_seed is None else sampler_seed + existing
    study = open_study(study_name, storage, sampler=make_sampler(seed, n_startup),
                       pruner=SlowTrialPruner(prune_ratio))

    reference = _prepare_study(study, factory, ts, space, existing, log)

    finished = len(study.get_trials(deepcopy=False, states=FINISHED))
    remaining = max(0, n_trials - finished)
    if on_start is not None:
        on_start(finished, remaining)
    objective = Objective(factory, space, ts, reference, report_every=report_every)
    failures = {"n": 0}

    def stop_on_repeated_failure(st: optuna.Study, tr: FrozenTrial) -> None:
        failures["n"] = failures["n"] + 1 if tr.state == TrialState.FAIL else 0
        if failures["n"] >= max_consecutive_failures:
            st.stop()

    ran = {"n": 0}

    def count(st: optuna.Study, tr: FrozenTrial) -> None:
        ran["n"] += 1

    callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = [
        optuna.study.MaxTrialsCallback(n_trials, states=FINISHED), stop_on_repeated_failure,
        count]
    if progress is not None:
        callbacks.append(progress)
    if deadline is not None:  # an absolute time.monotonic() bound that includes the reference
        left = max(1.0, deadline - time.monotonic())
        timeout = left if timeout is None else min(timeout, left)
    if remaining > 0:
        study.optimize(objective, n_trials=remaining, timeout=timeout, callbacks=callbacks,
                       catch=(Exception,), gc_after_trial=True)
        reference = _measure_reference_again(study, factory, ts, reference)
    fail_stale(study)
    if failures["n"] >= max_consecutive_failures:
        errs = [t.user_attrs.get("error") for t in study.get_trials(deepcopy=False)
                if t.state == TrialState.FAIL and t.user_attrs.get("error")]
        raise RuntimeError(f"{failures['n']} trials in a row failed; last error: "
                           f"{errs[-1] if errs else 'unknown (see the log above)'}")

    trials = study.get_trials(deepcopy=False)
    ft = feasible_trials(trials)
    best = ft[0] if ft else None
    prof = path = None
    if best is not None and profile_name:
        prof = profile_from_study(study, best, profile_name, storage_url=storage_url)
        path = save_profile(prof, profile_dir)
    return RunOutcome(study, ts, reference, best, prof, path, ran["n"])


def _prepare_study(study: optuna.Study, factory: Callable[..., Any], ts: TuneSettings,
                   space: SearchSpace, existing: int, log: Callable[[str], None]
                   ) -> dict[str, Any]:
    """What a study records once before its trials: the AdamW reference (returned), this
    machine's hardware, and the library defaults enqueued as its first trial."""
    reference = study.user_attrs.get("reference")
    if reference is None:
        log(f"Measuring the AdamW reference ({ts.steps} steps of {ts.workload!r})...")
        reference = measure_reference(factory, ts)
        study.set_user_attr("reference", reference)
    if "hardware" not in study.user_attrs:
        hw = detect()
        hw["host"]["host_adam_elements_per_s"] = measure_host_adam()
        hw["host"]["host_adam_measured_with"] = host_adam_settings()
        study.set_user_attr("hardware", hw)
    if existing == 0 and not study.user_attrs.get("defaults_enqueued"):
        study.set_user_attr("defaults_enqueued", True)
        study.enqueue_trial(space.defaults_params(), user_attrs={"enqueued": "library defaults"})
    return reference


def _measure_reference_again(study: optuna.Study, factory: Callable[..., Any],
                             ts: TuneSettings, reference: dict[str, Any]) -> dict[str, Any]:
    """The reference after the trials: the best of its throughput measurements (stored)."""
    # On a shared machine noise only ever slows a run down: measure AdamW's throughput
    # again after the trials and keep the best of its measurements, so the "vs AdamW"
    # ratio does not rest on one unlucky run.
    again = measure_reference(factory, ts)
    # this session's pair: the figure it started from and the one after its trials (a
    # noisy session long ago does not hide the column for ever)
    samples = [reference["throughput"], again["throughput"]]
    reference = dict(reference,
                     throughput=max(reference["throughput"], again["throughput"]),
                     throughput_measurements=reference.get("throughput_measurements", 1) + 1,
                     throughput_samples=samples)
    study.set_user_attr("reference", reference)
    return reference


def profile_from_study(study: optuna.Study, best: FrozenTrial, name: str, *,
                       storage_url: str | None = None) -> Profile:
    """A measured profile from the study's best feasible trial."""
    ua = study.user_attrs
    hw_detected = ua.get("hardware") or detect()
    trials = study.get_trials(deepcopy=False)
    states = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
    acc = hw_detected.get("accelerators") or []
    hardware = {
        "device": acc[0]["name"] if acc else f"CPU only ({hw_detected['host']['cpu']})",
        "host_cpu": hw_detected["host"]["cpu"],
        "host_cores": hw_detected["host"]["usable_cpus"],
        "host_memory_gb": hw_detected["host"].get("memory_gb"),
        "host_adam_elements_per_s": hw_detected["host"].get("host_adam_elements_per_s"),
        # None in studies from before the measurement ran the library's HostAdamW.
        "host_adam_measured_with": hw_detected["host"].get("host_adam_measured_with"),
        "accelerators": acc,
        "matching_builtin": hw_detected.get("matching_profile"),
    }
    ref = ua.get("reference", {})
    ts = ua.get("objective", {})
    provenance = {
        "source": "measured",
        "measured": True,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": hardware["device"],
        "versions": versions(),
        "study": study.study_name,
        "storage": redact_url(storage_url or default_storage_url()),
        "trial": best.number,
        "trial_counts": {k: v for k, v in states.items() if v},
        "n_feasible": len(feasible_trials(trials)),
        "objective": {
            "throughput": best.value,
            "unit": best.user_attrs.get("unit", ref.get("unit")),
            "heldout_loss": best.user_attrs.get("heldout_loss"),
            "loss_limit": best.user_attrs.get("loss_limit"),
            "adamw_heldout_loss": ref.get("heldout_loss"),
            "adamw_throughput": ref.get("throughput"),
            "initial_heldout_loss": ref.get("initial_loss"),
        },
        "tune_settings": ts,
        "note": "Throughput maximised subject to held-out loss within loss_margin of "
                "AdamW's held-out loss; see autotune/objective.py.",
    }
    settings = dict(best.user_attrs["settings"])
    return Profile(name=name, settings=settings, hardware=hardware, provenance=provenance,
                   description=f"Tuned by zenflow-tune on {hardware['device']} "
                               f"(study {study.study_name!r}, workload {ts.get('workload')!r})",
                   source="memory")


# ---- reporting --------------------------------------------------------------------------
def trial_summary(t: FrozenTrial) -> str:
    s = t.user_attrs.get("settings") or {}
    return (f"topk={s.get('topk_ratio', float('nan')):.3f} ui={s.get('update_interval')} "
            f"sel={s.get('select_interval')} chunk=2^{int(math.log2(s['chunk_size'])) if s.get('chunk_size') else '?'} "
            f"thr={s.get('host_threads')} lr_scale={_fmt_scale(s.get('host_lr_scale'))}"
            + (f" delay={s['apply_delay']}" if s.get("apply_delay") is not None else ""))


def _fmt_scale(v: Any) -> str:
    return v if isinstance(v, str) else ("?" if v is None else f"{v:.2f}")


NOISE_SPREAD = 1.25
"""AdamW's throughput measured before and after the trials: when the faster is more than this
times the slower, the machine's noise is larger than what a "vs AdamW" ratio could show."""


def reference_noise(ref: dict[str, Any]) -> str | None:
    """Why the "vs AdamW" column is left out (AdamW's measurements disagree by more than
    :data:`NOISE_SPREAD`), or None when it stands."""
    samples = list(ref.get("throughput_samples") or [])
    if len(samples) < 2:
        return None
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in samples):
        return f"AdamW's throughput measurements {samples} are not all positive numbers"
    if max(samples) <= NOISE_SPREAD * min(samples):
        return None
    unit = ref.get("unit", "items")
    return (f"AdamW's throughput measured {', '.join(f'{x:,.0f}' for x in samples)} {unit}/s "
            f"on this machine (a spread of {max(samples) / min(samples):.2f}x, above "
            f"{NOISE_SPREAD:g}x): the machine is too noisy for a ratio to mean anything")


def format_table(study: optuna.Study, top: int = 5) -> str:
    """The final table: best feasible trials, plus counts of the rest."""
    trials = study.get_trials(deepcopy=False)
    ref = study.user_attrs.get("reference", {})
    unit = ref.get("unit", "items")
    ft = feasible_trials(trials)[:top]
    head = (f"{'rank':>4} {'trial':>5} {unit + '/s':>11} {'vs AdamW':>8} {'loss':>7} "
            f"{'limit':>7} {'topk':>6} {'upd':>4} {'sel':>5} {'chunk':>6} {'thr':>4} "
            f"{'lr_scale':>8} {'delay':>5}")
    lines = [head, "-" * len(head)]
    noisy = reference_noise(ref)
    for i, t in enumerate(ft, 1):
        s = t.user_attrs["settings"]
        rel = (t.value / ref["throughput"] if ref.get("throughput") and noisy is None
               else float("nan"))
        lines.append(
            f"{i:>4} {t.number:>5} {t.value:>11,.0f} "
            f"{'-' if math.isnan(rel) else format(rel, '.2f') + 'x':>8} "
            f"{t.user_attrs['heldout_loss']:>7.4f} "
            f"{t.user_attrs['loss_limit']:>7.4f} {s['topk_ratio']:>6.3f} {s['update_interval']:>4} "
            f"{s['select_interval']:>5} {'2^' + str(int(math.log2(s['chunk_size']))):>6} "
            f"{s['host_threads']:>4} {_fmt_scale(s['host_lr_scale']):>8} "
            f"{delay_steps(s):>5}")
    if not ft:
        lines.append("  (no feasible trial)")
    n = {s: sum(t.state == s for t in trials) for s in TrialState}
    infeasible = sum(1 for t in trials if t.state == TrialState.COMPLETE and not is_feasible(t))
    if noisy is not None:
        lines.append(f"vs AdamW left out: {noisy}")
    lines.append(
        f"AdamW reference: {ref.get('throughput', float('nan')):,.0f} {unit}/s, held-out loss "
        f"{ref.get('heldout_loss', float('nan')):.4f} (from {ref.get('initial_loss') or float('nan'):.4f})")
    lines.append(
        f"trials: {len(trials)} total, {n[TrialState.COMPLETE]} complete "
        f"({n[TrialState.COMPLETE] - infeasible} feasible, {infeasible} infeasible), "
        f"{n[TrialState.PRUNED]} pruned, {n[TrialState.FAIL]} failed, "
        f"{n[TrialState.RUNNING]} running")
    return "\n".join(lines)


def describe_trial(t: FrozenTrial, unit: str) -> str:
    if t.state == TrialState.COMPLETE:
        tag = "feasible" if is_feasible(t) else (
            "diverged" if t.user_attrs.get("diverged") else "INFEASIBLE")
        loss = t.user_attrs.get("heldout_loss")
        loss_s = f"loss {loss:.4f}" if loss is not None else "loss n/a"
        return f"trial {t.number:>3}: {t.value:>9,.0f} {unit}/s  {loss_s}  {tag:<10} {trial_summary(t)}"
    if t.state == TrialState.PRUNED:
        return f"trial {t.number:>3}: pruned (clearly slow)            {trial_summary(t)}"
    return (f"trial {t.number:>3}: {t.state.name.lower()}: "
            f"{t.user_attrs.get('error', 'see log')}")


def now() -> float:
    return time.perf_counter()
