"""Speed from the step model, and the choice: the hardware and workload a run models, every
point's modelled step (:func:`rank_points`) and :func:`run_modelled`, the modelled objective
from its inputs to the pick (and the saved profile)."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

from zenflow_triton.profiles import (Profile, load_profile, read_profile_file, save_profile,
                                     validate_name)

from zenflow_triton.grads.stream import topology_refusal

from .. import stepmodel as M
from ..objective import TuneSettings
from ..realquality import DEFAULT_BAR
from .grid import LEAN_POINT, ModelledError, QualityGrid, QualityStore
from .outcome import PEER_MODES, SPEED_TOLERANCE, ModelledOutcome, ModelledRow
from .provenance import modelled_profile
from .quality_study import default_quality_settings, run_quality_grid
from .store import HOST_MEMORY_KEYS, real_quality_store


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


def _workload(model: str | M.Workload, tokens: int | None, mfu: float | None,
              micro_batch_tokens: int | None = None, loss: str | None = None) -> M.Workload:
    try:
        wl = model if isinstance(model, M.Workload) else M.Workload.from_spec(
            model, tokens=tokens or M.DEFAULT_TOKENS, mfu=M.DEFAULT_MFU if mfu is None else mfu)
        if loss is not None:
            wl = wl.replace(loss=loss)
        return wl if micro_batch_tokens is None else wl.replace(
            micro_batch_tokens=micro_batch_tokens)
    except M.StepModelError as e:
        raise ModelledError(str(e)) from None


def quality_first(eligible: list[ModelledRow],
                  tolerance: float = SPEED_TOLERANCE) -> ModelledRow | None:
    """The pick among ``eligible`` rows (fastest first): of those within ``tolerance`` of the
    fastest's throughput, the shortest ``update_interval``, then the largest ``topk_ratio``,
    then fp32 host moments over bf16 ones (the exact arithmetic where the host has room),
    then the fastest."""
    if not eligible:
        return None
    floor = eligible[0].throughput * (1.0 - tolerance)
    near = [r for r in eligible if r.throughput >= floor]
    return min(near, key=lambda r: (r.prediction.settings["update_interval"],
                                    -r.prediction.settings["topk_ratio"],
                                    r.prediction.settings.get("host_state_dtype") == "bfloat16",
                                    -r.throughput))


def rank_points(store: QualityStore, hw: M.Hardware, wl: M.Workload, *, gpus: int = 1,
                base_settings: dict[str, Any] | None = None,
                sharding: str = "ddp") -> list[ModelledRow]:
    """Every grid point with its modelled zenflow step (mode ``"zenflow"``, the point's
    settings over ``base_settings``, e.g. a profile's ``accumulate_on``), fastest first.
    ``eligible`` = feasible by the quality guard and fits in device memory. A point that
    does not fit with the window summed on the device is tried with it summed on the host
    (``accumulate_on="host"``): on the quality workload (fp32) the two train bit for bit
    alike, so the point's measured quality holds for both."""
    rows = []  # (wl without a micro-batch: each point at the largest micro-batch that fits)
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


def run_modelled(*, profile: str | Profile, model: str | M.Workload, gpus: int = 1,
                 tokens: int | None = None, mfu: float | None = None,
                 factory: Callable[..., Any] | None = None, ts: TuneSettings | None = None,
                 grid: QualityGrid | None = None, storage_url: str | None = None,
                 study_name: str | None = None, save_as: str | None = None,
                 profile_dir: str | Path | None = None,
                 host_adam_elements_per_s: float | None = None, lean: bool | None = None,
                 quality: str = "workload", bar: str = DEFAULT_BAR, sharding: str = "ddp",
                 micro_batch_tokens: int | None = None, loss: str | None = None,
                 log: Callable[[str], None] = print, **grid_kw: Any) -> ModelledOutcome:
    """Quality from the (shared, resumable) quality study (``quality="workload"``) or from the
    real-model store (``quality="real"``: nothing trained, judged by ``bar``;
    :func:`real_quality_store`), speed from the step model of ``model`` on ``profile``'s
    hardware (``gpus`` under ``sharding``: "ddp" or "fsdp2") at ``tokens`` per optimizer step,
    in micro-batches of ``micro_batch_tokens`` (None: each setting's largest that fits, at
    most 4096), its activations counting the loss as ``loss`` computes it (``"logits"`` or
    ``"chunked"``, :data:`~autotune.stepmodel.LOSSES`; None: the workload's own, ``"logits"``
    unless a Workload given as ``model`` says otherwise); of the feasible points that fit,
    the fastest, or within :data:`SPEED_TOLERANCE` of it the shortest window
    (:func:`quality_first`). Saves it as profile ``save_as`` (when given) in ``profile_dir``
    (default: the user profile dir). ``lean``: search each point's :data:`LEAN_POINT` variant too (True), never
    (False), or (None) where no plain point fits: then only the lean points that fit are
    trained (the real-model store holds the lean settings it measured as points of their own).

    Inputs are checked before any training: an unknown profile raises
    :class:`~zenflow_triton.profiles.ProfileNotFoundError`, an unknown preset or a profile
    without accelerator facts (``cpu``) :class:`ModelledError`."""
    _check_inputs(gpus, mfu, quality, sharding)
    prof, hw = load_hardware(profile, host_adam_elements_per_s)
    wl = _workload(model, tokens, mfu, micro_batch_tokens, loss)
    if save_as is not None:
        validate_name(save_as)
    where = dict(gpus=gpus, sharding=sharding)
    # the grid point overrides the profile's quality settings; the rest (accumulate_on,
    # chunk_size, host_threads...) are kept as the profile has them, in its order
    base = dict(prof.settings)
    if quality == "real":
        store = _real_store(hw, wl, where, base, grid, lean, bar, log)
    else:
        store = _workload_store(hw, wl, where, base, grid, lean, factory, ts, log,
                                storage_url=storage_url, study_name=study_name, **grid_kw)
    rows = rank_points(store, hw, wl, gpus=gpus, base_settings=base, sharding=sharding)
    eligible = [r for r in rows if r.eligible]
    zo = M.predict_fitting(hw, wl, "zero-offload", config=M.zenflow_config(base), **where)
    out = ModelledOutcome(store=store, hardware_profile=prof, hardware=hw, workload=wl,
                          gpus=gpus, rows=rows, best=quality_first(eligible),
                          zero_offload=zo, sharding=sharding,
                          peers={m: M.predict_fitting(hw, wl, m, config=M.zenflow_config(base),
                                                      **where) for m in PEER_MODES})
    if rows and not any(r.fits for r in rows):
        out.notes.append(_nothing_fits(hw, wl, where, base, rows, store.real is not None))
    elif rows and out.best is None:
        out.notes.append(_none_eligible(rows, where))
    if out.best is not None and save_as is not None:
        out.profile = modelled_profile(out, save_as)
        out.profile_path = save_profile(out.profile, profile_dir)
    return out


def _none_eligible(rows: list[ModelledRow], where: dict[str, Any]) -> str:
    """Why no setting that fits was picked: the fastest that fits, and what it failed (the
    quality bar, or the optimizer's refusal on this topology)."""
    r = next(r for r in rows if r.fits)
    s = r.point.settings
    why = (refused(r.settings, where) and "the optimizer refuses it on "
           f"{where['gpus']} GPU(s) under {where['sharding']}")
    if not why:
        v = getattr(r.point, "verdict", None)
        why = ("it failed the quality bar" + (f": {v.summary()}" if v is not None else ""))
    return (f"no eligible setting: the fastest that fits is topk_ratio={s['topk_ratio']:g}, "
            f"update_interval={s['update_interval']} (micro-batches of "
            f"{r.prediction.micro_batch_tokens} tokens), and {why}")


def _check_inputs(gpus: Any, mfu: float | None, quality: str, sharding: str) -> None:
    """:func:`run_modelled`'s arguments that no profile or preset is needed to check."""
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ModelledError(f"gpus must be an int >= 1, got {gpus!r}")
    if mfu is not None and not 0 < mfu <= 1:
        raise ModelledError(f"mfu must be in (0, 1], got {mfu}")
    if quality not in ("workload", "real"):
        raise ModelledError(f"quality must be 'workload' or 'real', got {quality!r}")
    if sharding not in M.SHARDINGS:
        raise ModelledError(f"unknown sharding {sharding!r}; shardings: "
                            f"{', '.join(M.SHARDINGS)}")


def _real_store(hw: M.Hardware, wl: M.Workload, where: dict[str, Any], base: dict[str, Any],
                grid: QualityGrid | None, lean: bool | None, bar: str,
                log: Callable[[str], None]) -> QualityStore:
    """:func:`run_modelled`'s quality from the real-model store (``quality="real"``)."""
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
    return store


def _workload_store(hw: M.Hardware, wl: M.Workload, where: dict[str, Any],
                    base: dict[str, Any], grid: QualityGrid | None, lean: bool | None,
                    factory: Callable[..., Any] | None, ts: TuneSettings | None,
                    log: Callable[[str], None], **study_kw: Any) -> QualityStore:
    """:func:`run_modelled`'s quality from the quality study on a workload
    (``quality="workload"``): the grid points it lacks are trained first."""
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
    return run_quality_grid(factory=factory, ts=ts, grid=grid, log=log, only=only, **study_kw)


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
    pred = M.predict_fitting(hw, wl, "zenflow", config=cfg, **where)
    for more in (dict(accumulate_on="host"), dict(accumulate_on="host", stream_grads=True)):
        if (pred.fits or all(getattr(cfg, k) == v for k, v in more.items())
                or refused(more, where)):
            continue
        leaner = M.predict_fitting(hw, wl, "zenflow", config=cfg.replace(**more), **where)
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
    """A point's settings over the base's. What the point's quality was measured with is the
    point's to say, not the base's: its ``apply_delay`` (None: the default schedule) and its
    host moments' dtype (:data:`~autotune.modelled.store.HOST_MEMORY_KEYS`; a base profile with
    bf16 moments must not make an fp32-measured point fit the host)."""
    settings = dict(base)
    settings.update(point)
    settings["apply_delay"] = point.get("apply_delay")  # a point without one: None
    for key, default in HOST_MEMORY_KEYS.items():
        settings[key] = point.get(key, default)
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
    on_device = [r.prediction for r in rows
                 if r.prediction.device_memory_bytes <= (hw.usable_device_bytes or 0)]
    if on_device and hw.host_memory_bytes:  # the host's memory binds, not the device's
        procs = hw.processes_per_host(where["gpus"])
        host = min(p.host_memory_bytes for p in on_device) * procs / 1e9
        text = (f"no grid point fits the host: of the points that fit the device, {wl.name} "
                f"needs at least {host:.1f} GB of host memory ({procs} process(es)); "
                f"{hw.name}'s host has {hw.host_memory_bytes / 1e9:.0f} GB, "
                f"{hw.usable_host_bytes / 1e9:.1f} usable")
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
