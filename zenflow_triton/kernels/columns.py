"""Gather and scatter of whole columns of a 2-D view (migration, apply of host results)."""

from __future__ import annotations

import torch


def gather_columns_ref(src2d: torch.Tensor, idx: torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous [rows, len(idx)] tensor (cast to ``dtype`` when given)."""
    out = src2d.index_select(1, idx)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def scatter_columns_ref(dst2d: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst2d[:, idx] = src (cast to dst2d's dtype); other columns untouched."""
    if idx.numel() == 0:
        return
    dst2d.index_copy_(1, idx, src.to(dst2d.dtype))
