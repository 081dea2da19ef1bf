"""The quality grid (:class:`QualityGrid`: the settings that change the arithmetic, a point
per combination) and the records of its results (:class:`QualityPoint` in a
:class:`QualityStore`), wherever they were measured."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..objective import TuneSettings
from ..realquality import KEY_LEFT_OUT, QUALITY_KEYS, RealStore, Verdict
from ..space import apply_delay_for, betas_values

QUALITY_TOPK_RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
QUALITY_UPDATE_INTERVALS = (1, 2, 4, 8, 16)
QUALITY_APPLY_DELAYS = (1.0,)
LEAN_POINT = dict(dense_params=(), accumulator_dtype="bfloat16")
"""A grid point's lean variant: no dense set, the window summed in bf16 (and, where the model
needs it, on the host: ``accumulate_on`` does not change the arithmetic of an fp32 sum, so
:func:`rank_points` chooses it). What a model too large for its card with the dense set
trains with; its quality is measured like any point's."""


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


def is_lean(point: dict[str, Any]) -> bool:
    return all(tuple(point.get(k) or ()) == tuple(v) if k == "dense_params"
               else point.get(k) == v for k, v in LEAN_POINT.items())
