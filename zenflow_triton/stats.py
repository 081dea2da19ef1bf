"""Memory accounting for ``stats()``: the bytes the optimizer holds on each side of the
link, and the share of elements the device owns. Reads the state, the pipeline's buffers and
the link; changes nothing."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .config import ZenFlowConfig
from .state import MATRIX, SMALL, state_side


def device_owned_fraction(params: Iterable[torch.Tensor], state: dict,
                          kind_of: Callable[[torch.Tensor], str]) -> float:
    """The share of trainable elements updated on the device every step (``kind_of``: the
    optimizer's classification, asked only for params without state yet)."""
    dev = total = 0
    for p in params:
        if not p.requires_grad:
            continue
        total += p.numel()
        st = state.get(p)
        kind = st.get("kind") if isinstance(st, dict) and "kind" in st else kind_of(p)
        if kind == MATRIX:
            dev += st["device_idx"].numel() * p.shape[0] if st else 0
        elif kind == SMALL:
            dev += p.numel()
    return dev / total if total else 0.0


def memory_bytes(state: dict, config: ZenFlowConfig, device_indices: Iterable[torch.Tensor],
                 pipeline, link) -> dict[str, int]:
    """Bytes of every tensor the optimizer holds, by side: ``device_state_bytes`` (the
    params' side: device-owned state, a device accumulator, index copies),
    ``host_state_bytes`` (host state, staging, outboxes, the workers' scratch, bounce
    buffers) and, of those, ``host_pinned_bytes``: the link buffers, pinned where CUDA
    exists. Each storage counts once, whole, on the side that holds it first (on a
    CPU-only run an index's "device" copy is the host index itself)."""
    seen: set[int] = set()
    out = dict(device_state_bytes=0, host_state_bytes=0, host_pinned_bytes=0)

    def add(side: str, t, link_buffer: bool = False) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        out[f"{side}_state_bytes"] += storage.nbytes()
        if link_buffer:
            out["host_pinned_bytes"] += storage.nbytes()

    for st in state.values():
        for key, value in (st.items() if isinstance(st, dict) else ()):
            if isinstance(value, torch.Tensor):
                add(state_side(key, config.accumulate_on), value)
    for on_device in device_indices:
        add("device", on_device)
    for buf, crosses in pipeline.host_buffers():
        add("host", buf, link_buffer=crosses)
    pinned_scratch, pageable_scratch = pipeline.scratch_bytes()
    fixed = pinned_scratch + link.bounce_bytes()
    out["host_state_bytes"] += fixed + pageable_scratch
    out["host_pinned_bytes"] += fixed
    return out


def optimizer_stats(*, steps: int, backend: str, shard, link, pipeline, params: list,
                    state: dict, kind_of: Callable[[torch.Tensor], str],
                    config: ZenFlowConfig, device_indices: Iterable[torch.Tensor],
                    counters: dict[str, int], streaming: dict[str, Any],
                    spread: dict[str, Any] | None = None) -> dict[str, Any]:
    """``ZenFlowOptimizer.stats()``: counters, link bytes each way, the device-owned share of
    elements, the bytes held on each side, host staging, host wait/busy seconds, and
    ``spread`` (``columns.spread.Spread.stats``: the first selection's share of the squared
    gradient in the top 10% of columns, whether that is spread, the window travel, whether
    that is far, whether the run went fresh).
    Reads; changes nothing."""
    multipliers = list(pipeline.multipliers.values())
    return dict(steps=steps, backend=backend, rank=shard.rank, world_size=shard.world,
                collective_bytes=shard.bytes, bytes_device_to_host=link.bytes_d2h,
                bytes_host_to_device=link.bytes_h2d,
                device_owned_fraction=device_owned_fraction(params, state, kind_of),
                host_staging_bytes=pipeline.staging_bytes(),
                **memory_bytes(state, config, device_indices, pipeline, link),
                host_inflight=pipeline.inflight,
                host_lr_multiplier_mean=(sum(multipliers) / len(multipliers)
                                         if multipliers else None),
                **counters, host_wait_seconds=pipeline.wait_seconds,
                host_busy_seconds=pipeline.busy_seconds, **streaming,
                spread=spread)
