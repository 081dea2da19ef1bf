"""Which gradients hold a NaN or an inf: one multi-tensor reduction per device, no host sync.

``nonfinite_flags(grads) -> bool [len(grads)]`` on the gradients' device (all on one device).
Each gradient's 2-norm is NaN when it holds a NaN and inf when it holds an inf. torch's
``_foreach_norm`` reduces a whole list in one multi-tensor kernel on CUDA (and is the
fastest of the foreach reductions on CPU: docs/host.md, "Measured on CPU"),
so the cost does not grow with the number of params; the caller reads the flag vector once
per step.

A finite gradient can still overflow a sum of squares (an element above ~1.8e19 in fp32 or
bf16): the norm then says inf, so every flagged gradient is checked exactly before it is
reported (:func:`confirm`), which only costs anything when a step is about to be refused.
fp16 gradients are reduced in fp32 (their squares overflow above 256). Both backends use
this file. Empty gradients are finite and must not be passed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ._multi import to_device_table


def nonfinite_flags(grads: Sequence[torch.Tensor], exact: bool = False) -> torch.Tensor:
    """Per gradient, True where its 2-norm is not finite (a NaN, an inf, or an overflow of
    the sum of squares): a superset of the non-finite gradients; :func:`confirm` decides.

    ``exact``: the norms are summed in fp64, where the squares of finite fp32, bf16 or fp16
    values cannot overflow (at most 1.2e77 each), so the flags are exactly the non-finite
    gradients, with no confirmation: for a check read later, when the gradient may be gone.
    Memory bound on a GPU alike; about 10x the fp32 reduction on a CPU."""
    if not grads:
        raise ValueError("nonfinite_flags needs at least one gradient")
    if any(g.numel() == 0 for g in grads):
        raise ValueError("nonfinite_flags: empty gradients are finite; leave them out")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    bads, order = [], []
    for dtype, idx in by_dtype.items():
        group = [grads[i] for i in idx]
        kw = ({"dtype": torch.float64} if exact
              else {"dtype": torch.float32} if dtype == torch.float16 else {})
        try:
            norms = torch._foreach_norm(group, 2, **kw)
        except (AttributeError, TypeError, RuntimeError):  # a torch without the foreach op
            norms = [torch.linalg.vector_norm(g, 2, **kw) for g in group]
        bads.append(torch.isfinite(torch.stack(norms)).logical_not_())
        order += idx
    if len(bads) == 1:
        return bads[0]
    # Back to the input order: a permutation known on the host, sent without a sync.
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[np.asarray(order)] = np.arange(len(order))
    return torch.cat(bads).index_select(0, to_device_table(inverse, grads[0].device))


def confirm(grad: torch.Tensor) -> bool:
    """Whether a flagged gradient really holds a NaN or an inf (one exact pass, one host
    read): rules out an overflow of the sum of squares."""
    return not bool(torch.isfinite(grad).all())


def nonfinite_flags_ref(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The contract, one tensor at a time (exact: no overflow)."""
    return torch.stack([~torch.isfinite(g).all() for g in grads])
