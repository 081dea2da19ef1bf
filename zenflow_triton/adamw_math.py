"""The AdamW update itself, element for element as ``torch.optim.AdamW`` (single-tensor path).

Every reference path (device kernels' torch references, the host AdamW) calls this one
function, so "equals torch.optim.AdamW step for step" is a property of one place.
"""

from __future__ import annotations

import math

import torch


def bias_corrections(beta1: float, beta2: float, step: float) -> tuple[float, float]:
    """(1 - beta1**step, sqrt(1 - beta2**step)) as Python floats, like torch's AdamW."""
    if step < 1:
        raise ValueError(f"Adam step must be >= 1, got {step}")
    return 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step)


def adamw_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
           exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, step: int) -> None:
    """In-place AdamW on fp32 tensors of one shape; ``step`` is the 1-based count after this update."""
    bc1, bc2_sqrt = bias_corrections(beta1, beta2, step)
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bc1))
