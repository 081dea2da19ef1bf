"""The modelled objective (``zenflow-tune run --objective modelled --profile P --model M``):
speed from the step-time model, quality from measured training runs.

Speed on hardware we do not have comes from :mod:`autotune.stepmodel` (tokens per second per
GPU of ``M`` on the facts of hardware profile ``P``). Quality cannot be modelled, but it does
not depend on the hardware either: whether a setting keeps the held-out loss within
``loss_margin`` of AdamW's depends only on the settings that change the arithmetic
(``topk_ratio``, ``update_interval``, ``select_interval``, ``host_lr_scale``, ``overlap``),
never on ``chunk_size`` or ``host_threads`` (the results are bit-identical across those).
So quality is measured once, on the embedded CPU workload, over a fixed grid of those
settings (:class:`QualityGrid`), and stored in an Optuna study (the *quality study*, same
storage as the tuner's other studies, named after the objective it measures:
:func:`quality_study_name`). Each grid point is one training run of the measured objective
(:func:`~autotune.objective.train_and_measure`), judged by the same guard
(:func:`~autotune.objective.quality_limit` over :func:`~autotune.objective.measure_reference`).
Only the points the study lacks are trained: a second profile, a second model, or a rerun
after a kill reuses every finished point.

The two are combined as in the measured objective: maximise throughput (here the modelled
tokens/s per GPU) subject to the quality guard. :func:`run_modelled` returns every grid
point ranked, the fastest feasible one that fits in device memory, and (optionally) saves it
as a profile whose provenance says ``"source": "modelled"`` and records the model preset,
GPUs, tokens, the quality study and the modelled step time and stall.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from zenflow_triton.profiles import (Profile, load_profile, read_profile_file, save_profile,
                                     validate_name)

from zenflow_triton.stream import topology_refusal
from . import stepmodel as M
from . import study as S
from .detect import versions
from .realquality import (DEFAULT_BAR, KEY_LEFT_OUT, OTHER_ARITHMETIC, QUALITY_KEYS, RealStore,
                          Verdict, bar_limits, load_store)
from .names import slug
from .space import apply_delay_for, betas_values, delay_steps
from .objective import (DIVERGED_VIOLATION, TuneSettings, guard_summary, measure_reference,
                        quality_limit, set_quality_constraint, train_and_measure)

__all__ = ["QUALITY_TOPK_RATIOS", "QUALITY_UPDATE_INTERVALS", "QualityGrid", "QualityPoint",
           "QualityStore", "ModelledRow", "ModelledOutcome", "ModelledError",
           "default_quality_settings", "quality_study_name", "run_quality_grid",
           "rank_points", "run_modelled", "modelled_profile", "format_modelled_table",
           "QUALITY_KEYS", "guard_line", "real_quality_store", "peer_lines", "fastest_peer",
           "is_lean", "PEER_MODES", "modelled_provenance", "default_save_name", "load_hardware"]

QUALITY_TOPK_RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
QUALITY_UPDATE_INTERVALS = (1, 2, 4, 8, 16)
QUALITY_APPLY_DELAYS = (1.0,)
LEAN_POINT = dict(dense_params=(), accumulator_dtype="bfloat16")
"""A grid point's lean variant: no dense set, the window summed in bf16 (and, where the model
needs it, on the host: ``accumulate_on`` does not change the arithmetic of an fp32 sum, so
:func:`rank_points` chooses it). What a model too large for its card with the dense set
trains with; its quality is measured like any point's."""
PEER_MODES = tuple(m for m in M.MODES if m != "zenflow")
"""The modes a pick is printed beside (AdamW, ZeRO-Offload and its variants, state-swap)."""
MAX_ATTEMPTS = 2
"""Training runs of one grid point that may fail (an exception, not a divergence) before the
quality study gives up on it."""


class ModelledError(ValueError):
    """A bad input to the modelled objective (unknown preset, a profile without accelerator
    facts, no grid point that fits or passes the guard...)."""


# ---- the quality grid ---------------------------------------------------------------------
@dataclass(frozen=True)
class QualityGrid:
    """Grid of quality-relevant settings: every ``topk_ratio`` x ``update_interval``, with
    ``select_interval = select_windows * update_interval`` and the library's default
    ``host_lr_scale`` unless given. ``chunk_size`` and ``host_threads`` are not in it: they
    do not change the result."""

    topk_ratios: tuple[float, ...] = QUALITY_TOPK_RATIOS
    update_intervals: tuple[int, ...] = QUALITY_UPDATE_INTERVALS
    select_windows: int | None = None
    """None: ZenFlowConfig's default (``select_interval=None`` = that many windows)."""
    host_lr_scale: float | str | None = None
    """None: ``ZenFlowConfig().host_lr_scale``, the library default."""
    overlap: bool = True
    apply_delays: tuple[float, ...] = QUALITY_APPLY_DELAYS
    """``apply_delay`` as fractions of each point's update interval, in (0, 1]: a point per
    distinct delay ``max(1, round(f * update_interval))`` (1.0: the next boundary, the
    default schedule). Ignored without overlap."""
    lean: bool = False
    """Also each point's :data:`LEAN_POINT` variant (after all the plain points)."""
    host_betas: tuple[str, ...] | None = None
    """``ZenFlowConfig.host_betas`` values: a point per value at each update interval above
    1 (at 1 they are the same computation: the first value only); None = the library's."""

    def __post_init__(self) -> None:
        if not self.topk_ratios or not self.update_intervals:
            raise ModelledError("a quality grid needs at least one topk_ratio and one "
                                "update_interval")
        if self.host_betas is not None:
            try:
                object.__setattr__(self, "host_betas", betas_values(self.host_betas))
            except ValueError as e:
                raise ModelledError(str(e)) from None
        if not self.apply_delays or not all(0 < f <= 1 for f in self.apply_delays):
            raise ModelledError("apply delays are fractions of the update interval in (0, 1], "
                                f"got {self.apply_delays!r}")

    def delays(self, ui: int) -> list[int | None]:
        """The distinct apply delays of the points with update interval ``ui`` (None: the
        next boundary)."""
        if not self.overlap:
            return [None]
        return list(dict.fromkeys(apply_delay_for(f, ui) for f in self.apply_delays))

    def points(self) -> list[dict[str, Any]]:
        """Validated settings (:data:`QUALITY_KEYS`) of every point, in grid order."""
        from zenflow_triton.config import (DEFAULT_SELECT_INTERVAL_WINDOWS, ConfigError,
                                           ZenFlowConfig)

        windows = self.select_windows or DEFAULT_SELECT_INTERVAL_WINDOWS
        lr_scale = (ZenFlowConfig().host_lr_scale if self.host_lr_scale is None
                    else self.host_lr_scale)
        betas = self.host_betas or (ZenFlowConfig().host_betas,)
        out = []
        for ui in self.update_intervals:
            for hb in (betas if int(ui) > 1 else betas[:1]):
                for delay in self.delays(int(ui)):
                    for k in self.topk_ratios:
                        try:
                            cfg = ZenFlowConfig(topk_ratio=float(k), update_interval=int(ui),
                                                select_interval=windows * int(ui),
                                                host_lr_scale=lr_scale, overlap=self.overlap,
                                                apply_delay=delay, host_betas=hb)
                        except ConfigError as e:
                            raise ModelledError(f"quality grid point topk_ratio={k}, "
                                                f"update_interval={ui}, apply_delay={delay}: "
                                                f"{e}") from None
                        out.append({key: getattr(cfg, key) for key in QUALITY_KEYS})
        if self.lean:
            out += [dict(p, **LEAN_POINT) for p in out]
        return out


def point_key(settings: dict[str, Any]) -> str:
    """A grid point's identity in the quality study (JSON of its quality settings; a value
    of :data:`KEY_LEFT_OUT`, or none, is left out)."""
    key = {k: settings[k] for k in QUALITY_KEYS if k not in KEY_LEFT_OUT}
    for k, omitted in KEY_LEFT_OUT.items():
        if settings.get(k, omitted) != omitted:
            key[k] = settings[k]
    return json.dumps(key, sort_keys=True)


@dataclass
class QualityPoint:
    settings: dict[str, Any]
    heldout_loss: float | None
    """None when the run diverged."""
    violation: float
    """``heldout_loss - limit`` (<= 0: feasible); :data:`DIVERGED_VIOLATION` if diverged."""
    feasible: bool
    diverged: bool
    trial: int
    cpu_throughput: float | None = None
    """Throughput of the run on the CPU that measured it (not used: speed is modelled)."""
    verdict: Verdict | None = None
    """A real-model point's verdict (:mod:`autotune.realquality`); then ``heldout_loss`` is
    its worst held-out loss minus AdamW's over the workloads, in nats."""


@dataclass
class QualityStore:
    """The quality study's results for one grid: every point's held-out loss and verdict."""

    study_name: str
    storage: str
    settings: TuneSettings | None
    """The quality study's objective (None for the real-model store)."""
    reference: dict[str, Any]
    limit: float
    points: list[QualityPoint]
    trials_run: int
    """Training runs this call made (0 when every point was already stored)."""
    real: RealSource | None = None
    """Where the quality came from real models (:func:`real_quality_store`), else None."""

    @property
    def n_feasible(self) -> int:
        return sum(p.feasible for p in self.points)


@dataclass
class RealSource:
    """A quality store read from the real-model store: the store, the bar it was judged by,
    and the points asked for that it has not measured (left out)."""
    store: RealStore
    bar: str
    unmeasured: list[dict[str, Any]] = field(default_factory=list)


def default_quality_settings(**overrides: Any) -> tuple[Callable[..., Any], TuneSettings]:
    """The factory and :class:`TuneSettings` of the default quality study: the embedded
    workload (``load_workload_factory(None)``) with the default objective (lr, steps,
    loss_margin...: ``TuneSettings``' defaults) on the CPU, unless overridden."""
    from .training import load_workload_factory

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


# ---- quality from real models -----------------------------------------------------------------
def real_quality_store(grid: QualityGrid | None = None, bar: str = DEFAULT_BAR,
                       path: str | Path | None = None, base: dict[str, Any] | None = None,
                       lean: bool | None = None) -> QualityStore:
    """Quality points from the real-model store (:mod:`autotune.realquality`), nothing
    trained: with ``grid``, its points, less those the store has not measured (listed in
    ``real.unmeasured``, never interpolated); without, every setting class the store has
    measured on its core workloads (``lean=False``: not the lean ones). A point is feasible
    when it passed ``bar`` on every workload it was measured on. ``base``: the profile's
    settings under the points; those of :data:`~autotune.realquality.OTHER_ARITHMETIC` it
    sets are part of every point's identity (a profile with bf16 host moments is not judged
    by rows with fp32 ones). A point that ``fresh_if_spread`` would switch on a spread
    gradient, where that switch did not pass, is the point with ``fresh_if_spread=False``
    (in its settings, so a saved profile pins it)."""
    limits = bar_limits(bar)
    rs = load_store(path)
    under = {k: v for k, v in (base or {}).items() if k in OTHER_ARITHMETIC}
    wanted = (grid.points() if grid is not None else
              [_quality_settings(e["settings"]) for e in rs.entries.values()])
    if lean is False:
        wanted = [p for p in wanted if not is_lean(p)]
    points: list[QualityPoint] = []
    unmeasured: list[dict[str, Any]] = []
    seen: set[str] = set()
    for settings in wanted:
        v = rs.verdict(dict(under, **settings), bar)
        if v.spread is not None and not v.passed:  # its switch on a spread gradient did not
            settings = dict(settings, fresh_if_spread=False)  # pass (or was not measured):
            v = rs.verdict(dict(under, **settings), bar)  # saved with it pinned off
        if v.key in seen:
            continue
        seen.add(v.key)
        if not v.measured:
            if grid is not None:  # (the store's own partial rows are not asked for)
                unmeasured.append(settings)
            continue
        excess = max((r.loss_delta - limits[r.kind]["loss"] for r in v.results), default=0.0)
        points.append(QualityPoint(settings=settings, heldout_loss=v.worst_loss_delta,
                                   violation=0.0 if v.passed else max(excess, 1e-9),
                                   feasible=v.passed, diverged=False, trial=-1, verdict=v))
    return QualityStore(study_name=f"real-models:{rs.path.name}", storage=str(rs.path),
                        settings=None, reference={}, limit=math.nan, points=points,
                        trials_run=0, real=RealSource(store=rs, bar=bar, unmeasured=unmeasured))


def is_lean(point: dict[str, Any]) -> bool:
    return all(tuple(point.get(k) or ()) == tuple(v) if k == "dense_params"
               else point.get(k) == v for k, v in LEAN_POINT.items())


def _quality_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings``' :data:`QUALITY_KEYS` as ``ZenFlowConfig`` resolves them (a grid point)."""
    from zenflow_triton.config import ZenFlowConfig

    cfg = ZenFlowConfig(**{k: v for k, v in settings.items() if k in QUALITY_KEYS})
    return dict({k: getattr(cfg, k) for k in QUALITY_KEYS},
                select_interval=cfg.effective_select_interval)


# ---- speed from the model, and the choice ---------------------------------------------------
@dataclass
class ModelledRow:
    point: QualityPoint
    prediction: M.Prediction
    settings: dict[str, Any]
    """The full profile settings the model was run with (base settings + the point)."""
    throughput: float = 0.0
    """Modelled tokens per second per GPU."""
    eligible: bool = False
    """Feasible by the quality guard and fits in device memory."""

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    @property
    def step_time_s(self) -> float:
        return self.prediction.modelled_step_time_s


def profile_of(value: str | Profile, device_memory_gb: float | None = None,
               host_memory_gb: float | None = None) -> Profile:
    """A profile by name, or read from a path to its JSON (a card of one's own: copy a
    built-in's file, ``zenflow-tune show NAME --json``, and edit its ``hardware``); with
    ``device_memory_gb``, the same hardware with that much device memory (a memory variant
    of a card, such as a 40 GB A100), named ``<name>-<N>gb``."""
    if isinstance(value, Profile):
        prof = value
    elif value.endswith(".json") or os.path.sep in value:
        prof = read_profile_file(value)
    else:
        prof = load_profile(value)
    if host_memory_gb is not None:  # the host's memory, a fact the fit check reads
        if not host_memory_gb > 0:
            raise ModelledError(f"host memory must be > 0 GB, got {host_memory_gb}")
        prof = dataclasses.replace(prof, hardware=dict(prof.hardware,
                                                       host_memory_gb=host_memory_gb))
    if device_memory_gb is None:
        return prof
    if not device_memory_gb > 0:
        raise ModelledError(f"device memory must be > 0 GB, got {device_memory_gb}")
    hardware = dict(prof.hardware, device_memory_gb=device_memory_gb)
    return dataclasses.replace(prof, name=f"{prof.name}-{device_memory_gb:g}gb",
                               hardware=hardware, path=None, source="memory")


def load_hardware(profile: str | Profile, host_adam_elements_per_s: float | None = None
                  ) -> tuple[Profile, M.Hardware]:
    """The profile (by name, or as given) and its facts as the step model reads them;
    :class:`ModelledError` for a profile without the accelerator facts (``cpu``)."""
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    hw = M.Hardware.from_profile(prof, host_adam_elements_per_s=host_adam_elements_per_s)
    try:
        hw.require_device()
    except M.StepModelError as e:
        raise ModelledError(str(e)) from None
    return prof, hw


def _workload(model: str | M.Workload, tokens: int | None, mfu: float | None) -> M.Workload:
    if isinstance(model, M.Workload):
        return model
    try:
        return M.Workload.from_spec(model, tokens=tokens or M.DEFAULT_TOKENS,
                                    mfu=M.DEFAULT_MFU if mfu is None else mfu)
    except M.StepModelError as e:
        raise ModelledError(str(e)) from None


def rank_points(store: QualityStore, hw: M.Hardware, wl: M.Workload, *, gpus: int = 1,
                base_settings: dict[str, Any] | None = None,
                sharding: str = "ddp") -> list[ModelledRow]:
    """Every grid point with its modelled zenflow step (mode ``"zenflow"``, the point's
    settings over ``base_settings``, e.g. a profile's ``accumulate_on``), fastest first.
    ``eligible`` = feasible by the quality guard and fits in device memory. A point that
    does not fit with the window summed on the device is tried with it summed on the host
    (``accumulate_on="host"``): on the quality workload (fp32) the two train bit for bit
    alike, so the point's measured quality holds for both."""
    rows = []
    for p in store.points:
        pred, settings = _prediction(hw, wl, dict(gpus=gpus, sharding=sharding),
                                     _over(base_settings or {}, p.settings))
        rows.append(ModelledRow(point=p, prediction=pred, settings=settings,
                                throughput=wl.tokens / pred.modelled_step_time_s,
                                eligible=p.feasible and pred.fits and not refused(
                                    settings, dict(gpus=gpus, sharding=sharding))))
    rows.sort(key=lambda r: (-r.throughput, math.inf if r.point.heldout_loss is None
                             else r.point.heldout_loss))
    return rows


@dataclass
class ModelledOutcome:
    store: QualityStore
    hardware_profile: Profile
    hardware: M.Hardware
    workload: M.Workload
    gpus: int
    rows: list[ModelledRow]
    best: ModelledRow | None
    zero_offload: M.Prediction
    sharding: str = "ddp"
    peers: dict[str, M.Prediction] = field(default_factory=dict)
    """The peer modes' predictions (:data:`PEER_MODES`) at the profile's base settings."""
    profile: Profile | None = None
    profile_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def eligible(self) -> list[ModelledRow]:
        return [r for r in self.rows if r.eligible]


def run_modelled(*, profile: str | Profile, model: str | M.Workload, gpus: int = 1,
                 tokens: int | None = None, mfu: float | None = None,
                 factory: Callable[..., Any] | None = None, ts: TuneSettings | None = None,
                 grid: QualityGrid | None = None, storage_url: str | None = None,
                 study_name: str | None = None, save_as: str | None = None,
                 profile_dir: str | Path | None = None,
                 host_adam_elements_per_s: float | None = None, lean: bool | None = None,
                 quality: str = "workload", bar: str = DEFAULT_BAR, sharding: str = "ddp",
                 log: Callable[[str], None] = print, **grid_kw: Any) -> ModelledOutcome:
    """Quality from the (shared, resumable) quality study (``quality="workload"``) or from the
    real-model store (``quality="real"``: nothing trained, judged by ``bar``;
    :func:`real_quality_store`), speed from the step model of ``model`` on ``profile``'s
    hardware (``gpus`` under ``sharding``: "ddp" or "fsdp2"); the fastest feasible point that
    fits. Saves it as profile ``save_as`` (when given) in ``profile_dir`` (default: the user
    profile dir). ``lean``: search each point's :data:`LEAN_POINT` variant too (True), never
    (False), or (None) where no plain point fits: then only the lean points that fit are
    trained (the real-model store holds the lean settings it measured as points of their own).

    Inputs are checked before any training: an unknown profile raises
    :class:`~zenflow_triton.profiles.ProfileNotFoundError`, an unknown preset or a profile
    without accelerator facts (``cpu``) :class:`ModelledError`."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ModelledError(f"gpus must be an int >= 1, got {gpus!r}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ModelledError(f"mfu must be in (0, 1], got {mfu}")
    if quality not in ("workload", "real"):
        raise ModelledError(f"quality must be 'workload' or 'real', got {quality!r}")
    if sharding not in M.SHARDINGS:
        raise ModelledError(f"unknown sharding {sharding!r}; shardings: "
                            f"{', '.join(M.SHARDINGS)}")
    prof, hw = load_hardware(profile, host_adam_elements_per_s)
    wl = _workload(model, tokens, mfu)
    if save_as is not None:
        validate_name(save_as)
    where = dict(gpus=gpus, sharding=sharding)
    # the grid point overrides the profile's quality settings; the rest (accumulate_on,
    # chunk_size, host_threads...) are kept as the profile has them, in its order
    base = dict(prof.settings)
    if quality == "real":
        if grid is not None and (lean or lean is None and not any(
                _fits(hw, wl, where, base, p) for p in grid.points())):
            grid = dataclasses.replace(grid, lean=True)  # (as the workload's grid does)
        # the lean settings the store measured compete like any other (their quality is
        # measured, nothing to train); --lean no leaves them out
        store = real_quality_store(grid, bar, base=base, lean=lean)
        if store.real.unmeasured:
            log(f"{len(store.real.unmeasured)} point(s) asked for are not measured on real "
                "models: left out (bench/convergence/study.py measures a setting; "
                "bench/convergence/quality_store.py adds it to the store)")
    else:
        if factory is None or ts is None:
            f, t = default_quality_settings()
            factory, ts = factory or f, ts or t
        grid = grid or QualityGrid()
        grid.points()  # validate before training
        only = None
        if lean is None and not grid.lean and not any(
                _fits(hw, wl, where, base, p) for p in grid.points()):
            grid, only = dataclasses.replace(grid, lean=True), _lean_or_fits(hw, wl, where, base)
            log(f"no grid point fits {wl.name} on {hw.name} with the dense set: adding the "
                f"lean variant ({', '.join(f'{k}={v!r}' for k, v in LEAN_POINT.items())}) of "
                "each point that then fits")
        elif lean:
            grid = dataclasses.replace(grid, lean=True)
        store = run_quality_grid(factory=factory, ts=ts, grid=grid, storage_url=storage_url,
                                 study_name=study_name, log=log, only=only, **grid_kw)
    rows = rank_points(store, hw, wl, gpus=gpus, base_settings=base, sharding=sharding)
    eligible = [r for r in rows if r.eligible]
    zo = M.predict(hw, wl, "zero-offload", config=M.zenflow_config(base), **where)
    out = ModelledOutcome(store=store, hardware_profile=prof, hardware=hw, workload=wl,
                          gpus=gpus, rows=rows, best=eligible[0] if eligible else None,
                          zero_offload=zo, sharding=sharding,
                          peers=M.predict_all(hw, wl, config=M.zenflow_config(base),
                                              modes=PEER_MODES, **where))
    if rows and not any(r.fits for r in rows):
        out.notes.append(_nothing_fits(hw, wl, where, base, rows, store.real is not None))
    if out.best is not None and save_as is not None:
        out.profile = modelled_profile(out, save_as)
        out.profile_path = save_profile(out.profile, profile_dir)
    return out


def _prediction(hw: M.Hardware, wl: M.Workload, where: dict[str, Any],
                settings: dict[str, Any]) -> tuple[M.Prediction, dict[str, Any]]:
    """The modelled zenflow step of ``settings``, or, where it does not fit with the window
    summed on the device, of the same summed on the host, and then with the gradient
    streamed off the device during backward (the same arithmetic, bit for bit: see
    :func:`rank_points`), with the settings it was made with. ``where``: the ``gpus`` and
    ``sharding`` of :func:`~autotune.stepmodel.predict`."""
    if refused(settings, where):  # (a profile's streaming, under DDP or FSDP2): without it
        settings = dict(settings, stream_grads=False)
    try:
        cfg = M.zenflow_config(settings)
    except M.StepModelError as e:
        raise ModelledError(f"settings {settings}: {e}") from None
    pred = M.predict(hw, wl, "zenflow", config=cfg, **where)
    for more in (dict(accumulate_on="host"), dict(accumulate_on="host", stream_grads=True)):
        if (pred.fits or all(getattr(cfg, k) == v for k, v in more.items())
                or refused(more, where)):
            continue
        leaner = M.predict(hw, wl, "zenflow", config=cfg.replace(**more), **where)
        if leaner.fits:
            return leaner, dict(settings, **more)
    return pred, settings


def refused(settings: dict[str, Any], where: dict[str, Any]) -> str | None:
    """Why the optimizer would refuse ``settings`` on ``where``'s GPUs and sharding (the
    optimizer's own rule, ``stream.topology_refusal``: no streaming under DDP or FSDP2), or
    None: what it refuses is neither ranked eligible nor saved."""
    return topology_refusal(settings, world=where.get("gpus", 1),
                            fsdp=where.get("sharding") == "fsdp2")


def _over(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    settings = dict(base)
    settings.update(point)
    settings["apply_delay"] = point.get("apply_delay")  # a point without one: None
    return settings


def _fits(hw: M.Hardware, wl: M.Workload, where: dict[str, Any], base: dict[str, Any],
          point: dict[str, Any]) -> bool:
    return _prediction(hw, wl, where, _over(base, point))[0].fits


def _lean_or_fits(hw: M.Hardware, wl: M.Workload, where: dict[str, Any], base: dict[str, Any]
                  ) -> Callable[[dict[str, Any]], bool]:
    """Keeps every plain point (the table shows them) and the lean points that fit."""
    def keep(point: dict[str, Any]) -> bool:
        lean = all(point.get(k) == v for k, v in LEAN_POINT.items())
        return not lean or _fits(hw, wl, where, base, point)
    return keep


def _nothing_fits(hw: M.Hardware, wl: M.Workload, where: dict[str, Any], base: dict[str, Any],
                  rows: list[ModelledRow], real: bool = False) -> str:
    """Why no grid point fits, and what would (settings the grid does not search yet)."""
    need = min(r.prediction.device_memory_bytes for r in rows) / 1e9
    has = (hw.device_memory_bytes or 0) / 1e9
    text = (f"no grid point fits: {wl.name} needs at least {need:.1f} GB of device memory "
            f"(activations of {wl.tokens} tokens included; host accumulation"
            f"{'' if refused(dict(stream_grads=True), where) else ' and gradient streaming'} "
            f"tried); {hw.name} has {has:.0f} GB, "
            f"{(hw.usable_device_bytes or 0) / 1e9:.1f} usable")
    floor = M.params_and_grads_bytes(wl, **where) / 1e9
    if floor > (hw.usable_device_bytes or 0) / 1e9:
        return text + (f": its params, two buckets of its largest gradient and the "
                       f"activations alone are {floor:.1f} GB (fewer tokens per step: --tokens)")
    cfg = M.zenflow_config(dict(base, stream_grads=False) if refused(base, where) else base)
    lean = M.fitting_zenflow(hw, wl, config=cfg, **where)
    if lean is None:
        return text
    changes = M.lean_changes(lean, cfg)
    names = ", ".join(f"{k}={v!r}" for k, v in changes.items())
    if refused(changes, where):
        return text + (f"; {names} would fit, but the optimizer refuses it on "
                       f"{where['gpus']} GPU(s) under {where['sharding']} (gradient streaming "
                       "is single-process only)")
    if real:
        return text + (f"; {names} would fit, a setting the real-model store has not "
                       "measured (bench/convergence/study.py, then quality_store.py; or "
                       "--quality workload to judge it on a workload)")
    return text + f"; {names} would fit (a point the grid does not hold: --topk-grid)"


def modelled_provenance(out: ModelledOutcome) -> dict[str, Any]:
    """What a modelled profile records about how its settings were chosen."""
    best = out.best
    if best is None:
        raise ModelledError("no feasible grid point fits: nothing to record")
    hw, wl, store = out.hardware, out.workload, out.store
    rate, how = hw.host_rate_and_source(out.gpus)
    measured_rate = bool(hw.host_adam_elements_per_s)
    zo_t = out.zero_offload.modelled_step_time_s
    p = best.prediction
    doc = {
        "source": "modelled",
        "measured": False,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware_profile": out.hardware_profile.name,
        "model": wl.name,
        "gpus": out.gpus,
        "tokens": wl.tokens,
        "mfu": wl.mfu,
        "dtype": wl.dtype,
        "sharding": out.sharding,
        "host_adam_elements_per_s_per_gpu": rate,
        "host_adam_source": (how if measured_rate else
                             f"the profile has no host_adam_elements_per_s (null): the step "
                             f"model's documented default was used ({how}; "
                             "docs/stepmodel.md, Constants)"),
        "objective": {
            "tokens_per_s_per_gpu": best.throughput,
            "step_time_s": p.modelled_step_time_s,
            "stall_fraction": p.stall_fraction,
            "host_busy_fraction": p.host_busy_fraction,
            "device_memory_gb": round(p.device_memory_bytes / 1e9, 2),
            "zero_offload_step_time_s": zo_t,
            "speedup_vs_zero_offload": zo_t / p.modelled_step_time_s,
        },
        "grid": {
            "topk_ratios": sorted({r.point.settings["topk_ratio"] for r in out.rows}),
            "update_intervals": sorted({r.point.settings["update_interval"] for r in out.rows}),
            "apply_delays": sorted({delay_steps(r.point.settings) for r in out.rows}),
            "host_betas": sorted({r.point.settings.get("host_betas", "step") for r in out.rows}),
            "points": len(out.rows),
            "feasible": sum(r.point.feasible for r in out.rows),
            "fit": sum(r.fits for r in out.rows),
        },
        "peers": {m: {"step_time_s": pr.modelled_step_time_s if pr.fits else None,
                      "fits": pr.fits,
                      "device_memory_gb": round(pr.device_memory_bytes / 1e9, 2),
                      "host_memory_gb": round(pr.host_memory_bytes / 1e9, 2)}
                  for m, pr in out.peers.items()},
        "versions": versions(),
    }
    if store.real is None:  # the quality study's verdict, where it always was
        ref = store.reference
        doc["objective"].update(heldout_loss=best.point.heldout_loss, loss_limit=store.limit,
                                adamw_heldout_loss=ref.get("heldout_loss"),
                                initial_heldout_loss=ref.get("initial_loss"))
        doc["grid"]["quality_trial"] = best.point.trial
    doc.update(_quality_provenance(out))
    return doc




def _quality_provenance(out: ModelledOutcome) -> dict[str, Any]:
    """Where a modelled profile's quality verdict came from: the real-model store (the
    models, workloads, seeds and the chosen setting's result on each) or the quality study
    on a workload (its objective and held-out losses)."""
    store, best = out.store, out.best
    if store.real is not None:
        rs, v = store.real.store, best.point.verdict
        return {
            "quality": {
                "source": "real models",
                "summary": f"{v.summary()} (bar {store.real.bar!r}): "
                           + "; ".join(r.describe() for r in v.results),
                "bar": store.real.bar,
                "limits": json.loads(json.dumps(bar_limits(store.real.bar))),
                "setting_class": v.name,
                "trains": {f"on a {kind} gradient": name for kind, name in v.trains.items()},
                "models": sorted({rs.workloads[r.workload]["model"] for r in v.results}),
                "seeds": sorted({seed for r in v.results for seed in r.seeds}),
                "workloads": {r.workload: {"seeds": list(r.seeds),
                                           "loss_delta": r.loss_delta,
                                           "accuracy_delta_pts": r.accuracy_delta_pts,
                                           "task": rs.workloads[r.workload]["task"],
                                           "model": rs.workloads[r.workload]["model"]}
                              for r in v.results},
                "store": {k: rs.provenance.get(k) for k in ("date", "commit", "command")},
            },
            "note": ("Settings chosen by zenflow-tune's modelled objective: the fastest "
                     "setting by the step-time model (autotune/stepmodel; a prediction, not a "
                     "measurement on this hardware) among those that fit in device memory and "
                     "stayed within the quality bar of AdamW on every real-model fine-tune "
                     "of the shipped store (autotune/data/real_quality.json, "
                     "bench/convergence/). Run `zenflow-tune run` on the machine for "
                     "measured settings."),
        }
    ref = store.reference
    return {
        "quality_study": store.study_name,
        "quality_storage": store.storage,
        "workload": store.settings.workload,
        "loss_margin": store.settings.loss_margin,
        "tune_settings": store.settings.to_dict(),
        "quality": {"source": f"the workload {store.settings.workload!r}",
                    "summary": f"held-out loss {best.point.heldout_loss:.4f} within the limit "
                               f"{store.limit:.4f} (AdamW {ref.get('heldout_loss', math.nan):.4f}"
                               f", margin {store.settings.loss_margin:g})"},
        "note": ("Settings chosen by zenflow-tune's modelled objective: the fastest grid "
                 "point by the step-time model (autotune/stepmodel; a prediction, not a "
                 "measurement on this hardware) among those whose held-out loss on the "
                 f"workload {store.settings.workload!r} was within loss_margin of AdamW's "
                 "(measured, hardware-independent) and whose state fits in device memory. "
                 "chunk_size and host_threads do not change the result and are not chosen "
                 "here. Run `zenflow-tune run` on the machine for measured settings."),
    }


def modelled_profile(out: ModelledOutcome, name: str) -> Profile:
    """The chosen point as a profile: the hardware profile's facts and other settings, the
    point's quality settings, and the modelled provenance."""
    if out.best is None:
        raise ModelledError("no feasible grid point fits in device memory: no profile to save")
    prof = out.hardware_profile
    return Profile(name=validate_name(name), settings=dict(out.best.settings),
                   hardware=dict(prof.hardware), provenance=modelled_provenance(out),
                   description=f"{prof.description or prof.name}; settings modelled for "
                               f"{out.workload.name} on {out.gpus} GPU(s)",
                   source="memory")


# ---- reporting ---------------------------------------------------------------------------------
def format_modelled_table(out: ModelledOutcome, top: int = 5) -> str:
    """The final table of a modelled run (like the measured run's): the best eligible rows,
    then the peers beside the pick (:func:`peer_lines`) and what the grid held."""
    store, wl = out.store, out.workload
    zo_t = out.zero_offload.modelled_step_time_s
    real = store.real is not None
    # a betas column where the grid searched host_betas
    betas = any(r.point.settings.get("host_betas", "step") != "step" for r in out.rows)
    quality = (f"{'dloss':>8} {'dacc':>6}" if real else f"{'loss':>7} {'limit':>7}")
    head = (f"{'rank':>4} {'tokens/s':>10} {'vs zero-off':>11} {'step s':>7} {'stall':>6} "
            f"{quality} {'topk':>6} {'upd':>4} {'sel':>5} {'delay':>5} "
            + (f"{'betas':<6} " if betas else "") + f"{'device side':<14}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(out.eligible[:top], 1):
        s = r.point.settings
        if real:
            acc = r.point.verdict.worst_accuracy_delta
            q = f"{r.point.heldout_loss:>+8.4f} {'-' if acc is None else format(acc, '+.1f'):>6}"
        else:
            q = f"{r.point.heldout_loss:>7.4f} {store.limit:>7.4f}"
        lines.append(
            f"{i:>4} {r.throughput:>10,.0f} {zo_t / r.step_time_s:>10.2f}x "
            f"{r.step_time_s:>7.3f} {r.prediction.stall_fraction:>6.0%} {q} "
            f"{s['topk_ratio']:>6.3g} {s['update_interval']:>4} {s['select_interval']:>5} "
            f"{delay_steps(s):>5} " + (f"{s.get('host_betas', 'step'):<6} " if betas else "")
            + f"{device_side(r.settings):<14}")
    if not out.eligible:
        lines.append("  (no feasible point fits)")
    if real:
        lines.append("dloss: the worst held-out loss minus AdamW's over the store's workloads "
                     "(nats, mean of seeds); dacc: the worst accuracy minus AdamW's (points)")
    lines.append(f"modelled zero-offload: {wl.tokens / zo_t:,.0f} tokens/s per GPU "
                 f"({zo_t:.3f} s/step); model {wl.name}, {out.gpus} GPU(s) ({out.sharding}), "
                 f"{wl.tokens} tokens/GPU/step on {out.hardware.name}")
    faster = [r for r in out.rows if r.fits and not r.point.feasible
              and (out.best is None or r.throughput > out.best.throughput)]
    if faster:
        f = faster[0]
        why = (f.point.verdict.summary() if real else "diverged"
               if f.point.heldout_loss is None
               else f"loss {f.point.heldout_loss:.4f} > {store.limit:.4f}")
        lines.append(f"fastest point overall: topk {f.point.settings['topk_ratio']:g}, "
                     f"interval {f.point.settings['update_interval']}, "
                     f"{f.throughput:,.0f} tokens/s, infeasible ({why})")
    lines += peer_lines(out)
    n = len(out.rows)
    nf = sum(r.point.feasible for r in out.rows)
    fit = sum(r.fits for r in out.rows)
    if real:
        rs = store.real
        lines.append(f"quality: {rs.store.describe()}; bar {rs.bar!r} "
                     f"({_bar_text(rs.bar)}); {n} measured setting(s), {nf} within it, "
                     f"{fit} fit in device memory"
                     + (f"; {len(rs.unmeasured)} asked for but not measured: left out"
                        if rs.unmeasured else ""))
        if out.best is not None:
            lines.append(f"the pick ({out.best.point.verdict.name}): "
                         + "; ".join(r.describe() for r in out.best.point.verdict.results))
    else:
        ref = store.reference
        lines.append(f"grid: {n} points, {nf} feasible, {n - nf} infeasible, {fit} fit in "
                     f"device memory; quality study {store.study_name!r} ({store.trials_run} "
                     f"run(s) trained now), AdamW held-out loss "
                     f"{ref.get('heldout_loss', math.nan):.4f} (from "
                     f"{ref.get('initial_loss') or math.nan:.4f})")
    lines += [f"note: {n}" for n in out.notes]
    return "\n".join(lines)


def _bar_text(bar: str) -> str:
    lim = bar_limits(bar)
    c, lm = lim["classification"], lim["lm"]
    return (f"classifiers within +{c['loss']:g} nats and {c['accuracy_pts']:g} points of AdamW, "
            f"LMs within +{lm['loss']:g} nats")


def peer_lines(out: ModelledOutcome) -> list[str]:
    """The pick beside every peer mode the step model has for this model and card, with
    device and host memory; where a peer that fits is faster, said plainly and by how much."""
    rows = []
    if out.best is not None:
        p = out.best.prediction
        rows.append(("zenflow (the pick)", p.modelled_step_time_s, p))
    for mode, p in out.peers.items():
        rows.append((mode, p.modelled_step_time_s if p.fits else None, p))
    if not rows:
        return []
    lines = ["beside the peers (modelled, the same model and card):",
             f"  {'mode':<20} {'step s':>8} {'device GB':>10} {'host GB':>8}"]
    for name, t, p in rows:
        lines.append(f"  {name:<20} {'no fit' if t is None else format(t, '.3f'):>8} "
                     f"{p.device_memory_bytes / 1e9:>10.1f} {p.host_memory_bytes / 1e9:>8.1f}")
    fastest = fastest_peer(out)
    if out.best is None:
        if fastest is not None:
            v, m = fastest
            lines.append(f"no ZenFlow setting qualifies here: use {m} ({v:.3f} s/step, "
                         "the fastest peer that fits)")
        return lines
    t = out.best.step_time_s
    if fastest is not None and fastest[0] < t:
        v, m = fastest
        lines.append(f"{m} is faster than the pick by {t / v - 1:.0%} ({v:.3f} s against "
                     f"{t:.3f} s per step, modelled): prefer it on this card")
    elif fastest is not None:
        v, m = fastest
        lines.append(f"the pick is the fastest: {v / t:.2f}x the next, {m} ({v:.3f} s/step)")
    return lines


def fastest_peer(out: ModelledOutcome) -> tuple[float, str] | None:
    """``(step seconds, mode)`` of the fastest peer mode that fits, or None."""
    return min(((p.modelled_step_time_s, m) for m, p in out.peers.items() if p.fits),
               default=None)


def device_side(settings: dict[str, Any]) -> str:
    """What of a row's settings decides its device memory: the dense set kept (``dense``) or
    not (``lean``), the window summed on the ``host`` or device, in bf16 or fp32, and the
    gradient streamed off the device during backward (``stream``)."""
    dense = "lean" if settings.get("dense_params") == () else "dense"
    stream = " stream" if settings.get("stream_grads") else ""
    if settings.get("update_interval", 2) <= 1:
        return dense + stream  # no window to sum
    acc = "bf16" if settings.get("accumulator_dtype") == "bfloat16" else "fp32"
    where = "host" if settings.get("accumulate_on") == "host" else "dev"
    return f"{dense} {where}-{acc}{stream}"


def guard_line(store: QualityStore) -> str:
    """The guard line (and warning) of the measured objective, for this store; for the
    real-model store, what it is."""
    if store.real is not None:
        return (f"quality guard: the real-model store, bar {store.real.bar!r} "
                f"({_bar_text(store.real.bar)}, on every workload, mean of seeds)")
    return guard_summary(store.reference, store.settings.loss_margin)


def default_save_name(profile: str, model: str, gpus: int, tokens: int | None) -> str:
    """The profile a modelled run saves by default: ``<profile>-<model>``, with the GPUs and
    tokens when not the defaults (a built-in is not shadowed by accident). A model given as
    a path to a config.json is named by its folder, a ``module:function`` by the function."""
    if model.endswith(".json") or os.path.sep in model:
        path = Path(model)
        model = (path.parent if path.suffix == ".json" else path).name or "model"
    elif ":" in model:
        model = model.rpartition(":")[2]
    name = f"{profile}-{model}"
    if gpus != 1:
        name += f"-{gpus}gpu"
    if tokens and tokens != M.DEFAULT_TOKENS:
        name += f"-{tokens}tok"
    return slug(name, 64)
