"""The host AdamW job alone: how long one window boundary's host update takes (this GPU's
host-owned elements over the host rate). It needs no accelerator facts, so it can be
checked against a host update measured on any machine."""

from __future__ import annotations

from typing import Any

from .hardware import Hardware
from .settings import _k, zenflow_config
from .workload import Workload


def host_update_seconds(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                        **settings: Any) -> float:
    """The model's time of one host AdamW job at a window boundary (ZenFlow, host-owned
    elements of this GPU's rows / host rate). Needs no accelerator facts (the cpu profile
    works), so it can be checked against a measured host update on any machine."""
    cfg = zenflow_config(config, **settings)
    e_host = sum(p.shape[0] * (p.cols - _k(cfg.topk_ratio, p.cols)) for p in wl.params
                 if p.is_matrix(cfg.min_offload_numel, cfg.dense_params))
    return e_host / gpus / hw.host_rate(gpus)
