"""Which gradients hold a NaN or an inf: one multi-tensor reduction per device, no host sync.

``nonfinite_flags(grads) -> bool [len(grads)]`` on the gradients' device (all on one device).
Each gradient's largest |g| (the inf-norm, in fp32) is NaN when it holds a NaN and inf when it
holds an inf, and finite values cannot overflow it (a sum of squares could). torch's
``_foreach_norm`` launches one multi-tensor kernel for the whole list on CUDA, so the cost
does not grow with the number of params; the caller reads the flag vector once per step.
Both backends use this file: there is nothing for a Triton kernel to add. Empty gradients
have no inf-norm; they are finite and must not be passed.
"""

from __future__ import annotations

from typing import Sequence

import torch

_INF = float("inf")


def nonfinite_flags(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    if not grads:
        raise ValueError("nonfinite_flags needs at least one gradient")
    if any(g.numel() == 0 for g in grads):
        raise ValueError("nonfinite_flags: empty gradients are finite; leave them out")
    try:
        norms = torch._foreach_norm(list(grads), _INF, dtype=torch.float32)
    except (AttributeError, TypeError, RuntimeError):  # a torch without the multi-tensor op
        norms = [torch.linalg.vector_norm(g, _INF, dtype=torch.float32) for g in grads]
    return torch.isfinite(torch.stack(norms)).logical_not_()


def nonfinite_flags_ref(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The contract, one tensor at a time."""
    return torch.stack([~torch.isfinite(g).all() for g in grads])
