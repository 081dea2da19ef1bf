"""Full AdamW for device-owned params (1-D and small), many tensors per call.

``params[i]`` any float dtype; ``masters[i]`` fp32 copy when params[i] is low precision else
None; ``ms``/``vs`` fp32; ``steps[i]`` the 1-based Adam step of params[i] after this update.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..adamw_math import adamw_


def adamw_ref(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
              masters: Sequence[torch.Tensor | None], steps: Sequence[int], *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    for p, g, m, v, master, step in zip(params, grads, ms, vs, masters, steps):
        w = master if master is not None else p
        adamw_(w, g.float() if g.dtype != torch.float32 else g, m, v, lr=lr, beta1=beta1,
               beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        if master is not None:
            p.copy_(master)
