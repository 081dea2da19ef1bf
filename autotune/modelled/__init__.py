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
point ranked, the fastest feasible one that fits in device memory (or, within 3% of it, the
one with the shortest window: :func:`quality_first`), and (optionally) saves it
as a profile whose provenance says ``"source": "modelled"`` and records the model preset,
GPUs, tokens, the quality study and the modelled step time and stall.
"""

from __future__ import annotations

from ..realquality import DEFAULT_BAR, QUALITY_KEYS
from .grid import (LEAN_POINT, QUALITY_APPLY_DELAYS, QUALITY_TOPK_RATIOS,
                   QUALITY_UPDATE_INTERVALS, ModelledError, QualityGrid, QualityPoint,
                   QualityStore, RealSource, is_lean, point_key)
from .outcome import PEER_MODES, SPEED_TOLERANCE, ModelledOutcome, ModelledRow
from .provenance import default_save_name, modelled_profile, modelled_provenance
from .quality_study import (MAX_ATTEMPTS, default_quality_settings, quality_study_name,
                            run_quality_grid)
from .rank import load_hardware, profile_of, quality_first, rank_points, run_modelled
from .report import (device_side, fastest_peer, format_modelled_table, guard_line,
                     memory_side, peer_lines)
from .store import real_quality_store

__all__ = ["QUALITY_TOPK_RATIOS", "QUALITY_UPDATE_INTERVALS", "QualityGrid", "QualityPoint",
           "QualityStore", "ModelledRow", "ModelledOutcome", "ModelledError",
           "default_quality_settings", "quality_study_name", "run_quality_grid",
           "rank_points", "run_modelled", "modelled_profile", "format_modelled_table",
           "QUALITY_KEYS", "guard_line", "real_quality_store", "peer_lines", "fastest_peer",
           "is_lean", "PEER_MODES", "modelled_provenance", "default_save_name", "load_hardware",
           "SPEED_TOLERANCE", "quality_first", "device_side", "memory_side"]
