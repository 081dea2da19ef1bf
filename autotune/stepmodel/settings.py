"""The ZenFlow settings the model reads: a validated ZenFlowConfig (the optimizer's own
validation and defaults), the settings a prediction reports, and how many columns of a
matrix the optimizer keeps on the device."""

from __future__ import annotations

from typing import Any, Mapping

from .base import StepModelError


def zenflow_config(config: Any = None, **overrides: Any):
    """A validated ZenFlowConfig (the optimizer's own validation and defaults)."""
    from zenflow_triton.config import ConfigError, ZenFlowConfig

    try:
        if config is None:
            cfg = ZenFlowConfig()
        elif isinstance(config, Mapping):
            cfg = ZenFlowConfig.from_dict(dict(config))
        else:
            cfg = config
        return cfg.replace(**overrides) if overrides else cfg
    except ConfigError as e:
        raise StepModelError(str(e)) from None


_SETTING_KEYS = ("topk_ratio", "update_interval", "select_interval", "overlap", "apply_delay",
                 "accumulate_on",
                 "accumulator_dtype", "host_state_dtype", "min_offload_numel", "host_threads",
                 "dense_params")


def _k(topk_ratio: float, cols: int) -> int:
    """Device-owned columns of a matrix, as the optimizer rounds them (partition.py)."""
    if topk_ratio <= 0:
        return 0
    return min(cols, max(1, round(topk_ratio * cols)))
