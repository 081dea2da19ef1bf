"""Quality from the real-model store (:mod:`autotune.realquality`): its verdicts as a
:class:`~autotune.modelled.grid.QualityStore`, nothing trained."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..realquality import (DEFAULT_BAR, OTHER_ARITHMETIC, QUALITY_KEYS, bar_limits,
                           load_store)
from .grid import QualityGrid, QualityPoint, QualityStore, RealSource, is_lean


# ---- quality from real models -----------------------------------------------------------------
def real_quality_store(grid: QualityGrid | None = None, bar: str = DEFAULT_BAR,
                       path: str | Path | None = None, base: dict[str, Any] | None = None,
                       lean: bool | None = None) -> QualityStore:
    """Quality points from the real-model store (:mod:`autotune.realquality`), nothing
    trained: with ``grid``, its points, less those the store has not measured (listed in
    ``real.unmeasured``, never interpolated); without, every setting class the store has
    measured on its core workloads (``lean=False``: not the lean ones), each with the
    host moments' dtype it ran with (:data:`HOST_MEMORY_KEYS`). A point is feasible
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


HOST_MEMORY_KEYS = {"host_state_dtype": "float32"}
"""Settings outside the searched grid (:data:`~autotune.realquality.OTHER_ARITHMETIC`) that a
measured class brings into its point where it ran with other than the default given here:
bf16 host moments are what a desktop's host memory may need, and the tuner may pick them
only as measured (the point is judged by the rows that ran with them, and a saved profile
pins them)."""


def _quality_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings``' :data:`QUALITY_KEYS` as ``ZenFlowConfig`` resolves them (a grid point),
    with its :data:`HOST_MEMORY_KEYS` where they are not the default."""
    from zenflow_triton.config import ZenFlowConfig

    cfg = ZenFlowConfig(**{k: v for k, v in settings.items() if k in QUALITY_KEYS})
    host = {k: settings[k] for k, default in HOST_MEMORY_KEYS.items()
            if settings.get(k, default) != default}
    return dict({k: getattr(cfg, k) for k in QUALITY_KEYS},
                select_interval=cfg.effective_select_interval, **host)
