"""The column rule: how many columns of a matrix are device-owned (``num_selected``), which
ones (``select_columns`` over the column scores), and the picks of a whole reselection
(``plan_selection``). The diagnostics and the step model import these; nothing else
re-derives them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ZenFlowConfig
from ..kernels import KernelOps
from ..transfer import Link
from .layout import shape2d, view2d

def num_selected(cols: int, topk_ratio: float) -> int:
    """k = round(topk_ratio * cols); at least 1 when topk_ratio > 0, none at 0."""
    if topk_ratio <= 0.0:
        return 0
    return min(cols, max(1, round(topk_ratio * cols)))


def select_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest scores; ties go to the lower index (stable sort), so
    every rank given the same scores picks the same set."""
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


@dataclass
class Move:
    """One param's new selection: ``new_idx`` the sorted device-owned columns (host numpy)."""
    p: torch.Tensor
    st: dict
    new_idx: np.ndarray
    beta1: float
    beta2: float


def plan_selection(items, state: dict, ops: KernelOps, link: Link,
                   cfg: ZenFlowConfig, shard=None,
                   also: dict[torch.device, torch.Tensor] | None = None,
                   scores: dict | None = None, measure=None):
    """A :class:`Move` per ``(group, param, grad)`` of ``items``: the top ``k`` columns by
    this gradient's scores, scored and picked on each param's device, the picks brought to
    the host in one copy per device (a few host syncs whatever the number of params).
    ``shard``: where each rank holds some rows of the params (FSDP2), its column scores are
    summed over the ranks first (``RowShard.sum_rows``), so every rank picks alike.

    ``scores``: param -> its column scores made already (gradient streaming adds them up
    during backward; its entries of ``items`` carry no gradient), instead of scoring ``g``.

    ``measure``: called with each param's (summed) scores (``columns.spread``); a param with
    nothing to rank (``k`` 0 or all its columns) is then scored for it alone.

    ``also``: per device, a 1-D tensor that must come to the host too (the NaN/inf flags of
    the step): it rides in the same copy as that device's picks (its own copy on a device
    without picks). Returns ``(moves, {device: its values as a numpy array})``; without
    ``also``, the moves alone."""
    picks: dict[torch.device, list] = {}
    moves: list = []
    ranked = []
    for group, p, g in items:
        cols = shape2d(p)[1]
        k = num_selected(cols, cfg.topk_ratio)
        beta1, beta2 = group["betas"]
        made = scores.get(p) if scores else None
        if k in (0, cols):  # nothing to rank: all columns on one side
            moves.append(Move(p, state[p], np.arange(k, dtype=np.int64), beta1, beta2))
            if measure is None or (made is None and g is None):
                continue
            k = None  # scored for ``measure`` alone, whatever the run's topk_ratio
        ranked.append((p, k, beta1, beta2, made if made is not None
                       else ops.column_scores(view2d(g, like=p), cfg.score)))
    summed = [r[-1] for r in ranked]
    if shard is not None:
        summed = shard.sum_rows(summed, "an all-reduce of the column scores")
    for (p, k, beta1, beta2, _), s in zip(ranked, summed):
        if measure is not None:
            measure(p, s)
        if k is not None:
            picks.setdefault(p.device, []).append((p, select_columns(s, k), beta1, beta2))
    brought = _bring_picks(picks, state, link, also, moves)
    return moves if also is None else (moves, brought)


def _bring_picks(picks: dict, state: dict, link: Link, also: dict | None,
                 moves: list) -> dict:
    """Each device's picks to the host in one copy (its ``also`` rider in the same copy),
    appended to ``moves``; returns the riders' values per device."""
    riders = dict(also or {})
    brought = {}
    for device, device_picks in picks.items():
        parts = [idx for _, idx, _, _ in device_picks]
        rider = riders.pop(device, None)
        if rider is not None:
            parts.append(rider.to(parts[0].dtype))
        flat = link.to_host(torch.cat(parts)).numpy()
        off = 0
        for p, idx, beta1, beta2 in device_picks:
            n = idx.numel()
            moves.append(Move(p, state[p], flat[off:off + n], beta1, beta2))
            off += n
        if rider is not None:
            brought[device] = flat[off:]
    for device, rider in riders.items():  # a device with flags and no picks
        brought[device] = link.to_host(rider).numpy()
    return brought
