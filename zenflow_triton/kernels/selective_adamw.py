"""Fused selective AdamW: update columns ``idx`` of ``p`` from compact fp32 state, in place.

``p2d`` [rows, cols] (fp32/bf16/fp16), ``g2d`` [rows, cols], ``idx`` [k] sorted int64,
``m``, ``v`` fp32 [rows, k], ``master`` fp32 [rows, k] when ``p`` is low precision else None.
"""

from __future__ import annotations

import torch

from ..adamw_math import adamw_


def selective_adamw_ref(p2d: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                        m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None, *,
                        lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, step: int) -> None:
    if idx.numel() == 0:
        return
    g = g2d.index_select(1, idx).float()
    w = master if master is not None else p2d.index_select(1, idx).float()
    adamw_(w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step)
    p2d.index_copy_(1, idx, w.to(p2d.dtype))
