"""The ``[rows, cols]`` view of a param that the column split works on: columns are the
unit of selection, in the param's memory order."""

from __future__ import annotations

import math

import torch


def shape2d(p: torch.Tensor) -> tuple[int, int]:
    rows = p.shape[0]
    return rows, p.numel() // rows if rows else math.prod(p.shape[1:])


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dims as the columns of its [rows, cols] view run: dim 0 (the rows) first, the
    others outermost first in memory (by decreasing stride, ties in dim order). The identity
    for a contiguous tensor; for a ``channels_last`` conv weight [O, I, kh, kw] it is
    (0, 2, 3, 1), so each row's columns are contiguous in memory."""
    if t.dim() <= 2 or t.is_contiguous():
        return tuple(range(t.dim()))
    rest = sorted(range(1, t.dim()), key=lambda d: (-t.stride(d), d))
    return (0, *rest)


def view2d(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The [rows, cols] view of a param (a view: writes land in the param), or of a grad or
    state tensor laid out ``like`` its param (the param's column order: :func:`memory_order`;
    a copy when its own layout differs, which only reading needs)."""
    rows = t.shape[0]
    order = memory_order(like if like is not None else t)
    if order != tuple(range(t.dim())):
        t = t.permute(order)
    return t.reshape(rows, t.numel() // rows if rows else math.prod(t.shape[1:]))


def splittable(p: torch.Tensor) -> bool:
    """Whether :func:`view2d` of ``p`` is a view of its memory (the device half writes into
    it): dense layouts whose rows are the outermost dim (``channels_last`` included), and
    2-D params of any strides."""
    try:
        p.permute(memory_order(p)).view(p.shape[0], math.prod(p.shape[1:]))
    except RuntimeError:
        return False
    return True
