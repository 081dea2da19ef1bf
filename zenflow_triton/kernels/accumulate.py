"""Accumulate the gradient of host-owned columns: acc += scale * g2d[:, idx] in fp32.

``acc`` fp32 [rows, n] (compact, host-owned columns only), ``idx`` [n] sorted int64.
"""

from __future__ import annotations

import torch


def accumulate_columns_ref(acc: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                           scale: float = 1.0) -> None:
    if idx.numel() == 0:
        return
    g = g2d.index_select(1, idx).float()
    if scale == 1.0:
        acc.add_(g)
    else:
        acc.add_(g, alpha=scale)
