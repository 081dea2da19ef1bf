"""The quality study: the grid's points trained on a workload (one run each of the measured
objective, judged by its quality guard), stored in an Optuna study and reused by every
profile and model; only the points the study lacks are trained."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from .. import study as S
from ..names import slug
from ..objective import (DIVERGED_VIOLATION, TuneSettings, measure_reference, quality_limit,
                         set_quality_constraint, train_and_measure)
from ..realquality import KEY_LEFT_OUT
from .grid import QualityGrid, QualityPoint, QualityStore, point_key

MAX_ATTEMPTS = 2
"""Training runs of one grid point that may fail (an exception, not a divergence) before the
quality study gives up on it."""


def default_quality_settings(**overrides: Any) -> tuple[Callable[..., Any], TuneSettings]:
    """The factory and :class:`TuneSettings` of the default quality study: the embedded
    workload (``load_workload_factory(None)``) with the default objective (lr, steps,
    loss_margin...: ``TuneSettings``' defaults) on the CPU, unless overridden."""
    from ..training import load_workload_factory

    name, factory = load_workload_factory(overrides.pop("workload", None))
    overrides.setdefault("device", "cpu")
    return factory, TuneSettings(workload=name, **overrides)


def quality_study_name(ts: TuneSettings) -> str:
    """``quality-<workload>-<hash of the objective>``: one study per objective, shared by
    every hardware profile and model."""
    digest = hashlib.sha1(json.dumps(ts.to_dict(), sort_keys=True).encode()).hexdigest()[:10]
    return f"quality-{slug(ts.workload, 40, fallback='workload')}-{digest}"


def _grid_trials(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if "grid_key" in t.user_attrs]


def run_quality_grid(*, factory: Callable[..., Any], ts: TuneSettings,
                     grid: QualityGrid | None = None, storage_url: str | None = None,
                     study_name: str | None = None, log: Callable[[str], None] = print,
                     heartbeat_interval: int | None = None,
                     grace_period: int | None = None,
                     only: Callable[[dict[str, Any]], bool] | None = None) -> QualityStore:
    """Create or resume the quality study and train every grid point it lacks (one run each
    of ``ts.steps`` steps of ``factory``'s workload, from ``ts.seed``); return every point's
    result (of the points ``only`` keeps, when given). A point whose run is RUNNING in
    another process is waited for (a killed one becomes FAIL after the heartbeat grace
    period and is trained again here)."""
    grid = grid or QualityGrid()
    points = [p for p in grid.points() if only is None or only(p)]
    name = study_name or quality_study_name(ts)
    kw: dict[str, Any] = {}
    if heartbeat_interval:
        kw["heartbeat_interval"] = heartbeat_interval
    if grace_period:
        kw["grace_period"] = grace_period
    study, ts, reference = _open_quality_study(name, factory, ts, S.make_storage(storage_url,
                                                                                 **kw), log)
    limit = quality_limit(float(reference["heldout_loss"]), ts.loss_margin)
    wanted = {point_key(p): p for p in points}
    progress = _GridProgress(log, limit)
    _train_missing(study, wanted, _grid_objective(factory, ts, limit), progress, log,
                   ts.steps)
    return QualityStore(study_name=name, storage=S.redact_url(storage_url
                                                              or S.default_storage_url()),
                        settings=ts, reference=dict(reference), limit=limit,
                        points=_stored_points(study, wanted), trials_run=progress.ran)


def _open_quality_study(name: str, factory: Callable[..., Any], ts: TuneSettings,
                        storage: Any, log: Callable[[str], None]
                        ) -> tuple[optuna.Study, TuneSettings, dict[str, Any]]:
    """The quality study (created when new), its objective (``ts``, checked against a stored
    one) and its AdamW reference (measured once, then stored)."""
    study = optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                sampler=optuna.samplers.RandomSampler(seed=0),
                                load_if_exists=True)
    S.fail_stale(study)
    ts = S.check_or_store_objective(study, ts)
    if "kind" not in study.user_attrs:
        study.set_user_attr("kind", "quality-grid")
    reference = study.user_attrs.get("reference")
    if reference is None:
        log(f"Measuring the AdamW reference ({ts.steps} steps of {ts.workload!r})...")
        reference = measure_reference(factory, ts)
        study.set_user_attr("reference", reference)
    return study, ts, reference


def _grid_objective(factory: Callable[..., Any], ts: TuneSettings,
                    limit: float) -> Callable[[optuna.Trial], float]:
    """One grid point's training run (its settings in the trial's ``grid_key``), judged by
    the quality guard; the value is the held-out loss."""

    def objective(trial: optuna.Trial) -> float:
        from zenflow_triton import ZenFlowOptimizer

        key = trial.user_attrs.get("grid_key")
        if key is None:  # not one of ours (another process emptied the queue first)
            raise optuna.TrialPruned("not a quality grid point")
        settings = json.loads(key)
        trial.set_user_attr("settings", settings)

        def make(params):
            return ZenFlowOptimizer(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                                    weight_decay=ts.weight_decay, **settings)

        try:
            res = train_and_measure(factory, make, ts)
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            raise
        violation = DIVERGED_VIOLATION if res.diverged else res.heldout_loss - limit
        set_quality_constraint(trial, violation)
        trial.set_user_attr("heldout_loss", None if res.diverged else res.heldout_loss)
        trial.set_user_attr("loss_limit", limit)
        trial.set_user_attr("feasible", violation <= 0)
        trial.set_user_attr("diverged", res.diverged)
        trial.set_user_attr("cpu_throughput", res.throughput
                            if math.isfinite(res.throughput) else None)
        trial.set_user_attr("unit", res.unit)
        return DIVERGED_VIOLATION if res.diverged else res.heldout_loss

    return objective


class _GridProgress:
    """A ``log`` line per finished grid point, and how many were trained (``ran``)."""

    def __init__(self, log: Callable[[str], None], limit: float) -> None:
        self.log, self.limit = log, limit
        self.ran = 0
        self.started = time.perf_counter()

    def __call__(self, st: optuna.Study, tr: FrozenTrial) -> None:
        if "grid_key" not in tr.user_attrs:
            return
        self.ran += 1
        s = json.loads(tr.user_attrs["grid_key"])
        head = (f"quality point topk_ratio={s['topk_ratio']:g} "
                f"update_interval={s['update_interval']}"
                + ("".join(f" {k}={s[k]}" for k in KEY_LEFT_OUT if k in s))
                + (" dense_params=()" if s.get("dense_params") == [] else "") + ": ")
        if tr.state == TrialState.COMPLETE:
            loss = tr.user_attrs.get("heldout_loss")
            verdict = "feasible" if tr.user_attrs.get("feasible") else (
                "diverged" if tr.user_attrs.get("diverged") else "infeasible")
            self.log(head + (f"held-out loss {loss:.4f} " if loss is not None else "") +
                     f"(limit {self.limit:.4f}) {verdict}  "
                     f"[{time.perf_counter() - self.started:.0f} s]")
        else:
            self.log(head + f"{tr.state.name.lower()}: {tr.user_attrs.get('error', 'see log')}")


def _train_missing(study: optuna.Study, wanted: dict[str, dict[str, Any]],
                   objective: Callable[[optuna.Trial], float], progress: _GridProgress,
                   log: Callable[[str], None], steps: int) -> None:
    """Enqueue and train the wanted points the study lacks, until each has a complete run;
    points RUNNING in another process are waited for. A point whose run raised
    :data:`MAX_ATTEMPTS` times stops it (RuntimeError)."""
    announced = False
    while True:
        trials = _grid_trials(study)
        done = {t.user_attrs["grid_key"] for t in trials if t.state == TrialState.COMPLETE}
        queued = {t.user_attrs["grid_key"] for t in trials
                  if t.state in (TrialState.WAITING, TrialState.RUNNING)}
        failed: dict[str, list[FrozenTrial]] = {}
        for t in trials:  # runs that raised (a killed process leaves no "error": retried)
            if t.state == TrialState.FAIL and "error" in t.user_attrs:
                failed.setdefault(t.user_attrs["grid_key"], []).append(t)
        missing = [k for k in wanted if k not in done and k not in queued]
        for k in missing:
            if len(failed.get(k, [])) >= MAX_ATTEMPTS:
                err = failed[k][-1].user_attrs.get("error", "unknown error")
                raise RuntimeError(f"quality grid point {k} failed {MAX_ATTEMPTS} times in "
                                   f"study {study.study_name!r}; last error: {err}")
        todo = len(wanted.keys() - done)
        if todo and not announced:
            announced = True
            stored = len(done & wanted.keys())
            log(f"quality study {study.study_name!r}: "
                + (f"{stored} of {len(wanted)} grid points stored, training the {todo} missing"
                   if stored else f"training {todo} grid point(s)")
                + f", {steps} steps each")
        for k in missing:
            study.enqueue_trial({}, user_attrs={"grid_key": k})
        waiting = [t for t in _grid_trials(study) if t.state == TrialState.WAITING
                   and t.user_attrs["grid_key"] in wanted]
        if waiting:
            study.optimize(objective, n_trials=len(waiting), callbacks=[progress],
                           catch=(Exception,), gc_after_trial=False)
            continue
        running = [t for t in _grid_trials(study) if t.state == TrialState.RUNNING
                   and t.user_attrs["grid_key"] in wanted]
        if not running:
            break
        time.sleep(1.0)  # another process is training these points (or died: fail_stale)
        S.fail_stale(study)


def _stored_points(study: optuna.Study, wanted: dict[str, dict[str, Any]]) -> list[QualityPoint]:
    """Every wanted point's result: the latest complete run of each."""
    by_key: dict[str, FrozenTrial] = {}
    for t in _grid_trials(study):
        if t.state == TrialState.COMPLETE and t.user_attrs["grid_key"] in wanted:
            by_key[t.user_attrs["grid_key"]] = t  # the latest complete run of each point
    out = []
    for k, settings in wanted.items():
        t = by_key[k]
        v = float(t.user_attrs.get("quality_violation", DIVERGED_VIOLATION))
        out.append(QualityPoint(settings=dict(settings), heldout_loss=t.user_attrs.get(
            "heldout_loss"), violation=v, feasible=v <= 0,
            diverged=bool(t.user_attrs.get("diverged")), trial=t.number,
            cpu_throughput=t.user_attrs.get("cpu_throughput")))
    return out
