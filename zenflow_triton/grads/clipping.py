"""Clipping by the global norm (``ZenFlowConfig.max_grad_norm``), computed as
``torch.nn.utils.clip_grad_norm_`` computes it, so that one micro-batch per step gives its
bits:

* each gradient's 2-norm in the gradient's dtype, by torch's foreach norm (the kernel
  ``clip_grad_norm_`` runs), one call per device and dtype;
* the 2-norm of those norms, taken in ``clip_grad_norm_``'s order: grouped by device and
  dtype, the groups in the order torch's own grouping gives them (not the order of the
  params: with bf16 matrices and fp32 norms the two orders round differently), stacked on
  the first gradient's device;
* the coefficient ``min(1, max_norm / (norm + 1e-6))``, multiplied into every gradient in its
  dtype by torch's foreach multiply, one call per device and dtype.

The order of the gradients is the optimizer's (its param groups, in order): the same as
``clip_grad_norm_(model.parameters())`` where one group holds the model's params in order.

Under FSDP2 each rank holds its rows of every gradient. A gradient's norm is then the root
of the sum over the ranks of its rows' squared norms (fp32 norms, squared and summed in
fp64), rounded to the gradient's dtype. The sums ride the step's vote on the NaN/inf flags
(``RowShard.ride``), so clipping adds no collective where that check runs; every rank gets
the same sums and so the same coefficient. This norm is not ``clip_grad_norm_``'s bit for
bit (its per-gradient reduction runs over all the rows at once), but within a few fp32
roundings of it (tests/test_fsdp2.py states the bound).

With gradient streaming (``stream.GradStream``) the hooks take each streamed gradient's
norm as it is made and the stream scales what it holds; this module does the rest."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def grouped(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` grouped by (device, dtype), each group in the order of
    ``tensors``, the groups in the order torch's grouping gives (``clip_grad_norm_``'s)."""
    if not tensors:
        return []
    groups = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    return [list(indices) for _, (_, indices) in groups.items()]


def tensor_norms(grads: Sequence[torch.Tensor], dtype: torch.dtype | None = None
                 ) -> list[torch.Tensor]:
    """Each gradient's 2-norm on its device, in its dtype (or ``dtype``): one foreach norm
    per device and dtype, as ``clip_grad_norm_`` computes them."""
    out: list[torch.Tensor] = [None] * len(grads)  # type: ignore[list-item]
    for indices in grouped(grads):
        norms = torch._foreach_norm([grads[i] for i in indices], 2.0, dtype=dtype)
        for i, n in zip(indices, norms):
            out[i] = n
    return out


def total_norm(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of per-gradient norms (each in its gradient's dtype, on its device, in the
    gradients' order) as ``clip_grad_norm_`` takes it: in its order (:func:`grouped`),
    stacked on the first one's device."""
    first = norms[0].device
    order = [i for indices in grouped(norms) for i in indices]
    return torch.linalg.vector_norm(torch.stack([norms[i].to(first) for i in order]), 2.0)


def coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))``, as ``clip_grad_norm_`` computes it."""
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)


def scale(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """Every tensor times ``coef``, in place, in its dtype: one foreach multiply per device
    and dtype, as ``clip_grad_norm_`` scales the gradients."""
    for indices in grouped(tensors):
        group = [tensors[i] for i in indices]
        torch._foreach_mul_(group, coef.to(group[0].device))


class Clipper:
    """The optimizer's ``max_grad_norm``: :meth:`offer` before the step's NaN/inf check,
    :meth:`clip` after the step's waits (an interrupted step is retried unclipped)."""

    def __init__(self, max_norm: float | None, shard, stream) -> None:
        self.max_norm, self.shard, self.stream = max_norm, shard, stream
        self.across = shard.collective and not shard.split_rows
        """FSDP2 over several ranks: each holds its rows of every gradient."""
        self.norm: torch.Tensor | None = None
        """The global norm of the last clipped step, before clipping."""

    def offer(self, work) -> None:
        """Under FSDP2, each gradient's squared norm over this rank's rows, for the step's
        vote on the NaN/inf flags to sum over the ranks (or :meth:`clip` itself)."""
        if self.max_norm is None or not self.across or not work:
            return
        grads = [g for _, _, g in work]
        first = grads[0].device
        norms = torch.stack([n.to(first) for n in tensor_norms(grads, torch.float32)])
        self.shard.ride(norms.double().square())  # fp32 squared in fp64: exact

    def clip(self, work) -> None:
        """Scale every gradient of the step (``work``: (group, param, grad)) by the one
        coefficient of their global norm."""
        if self.max_norm is None or not work:
            return
        streamed = [self.stream.norm_of(p) for _, p, _ in work]
        grads = [g for (_, _, g), n in zip(work, streamed) if n is None]
        if self.across:  # (FSDP2 streams nothing: every gradient is in grads)
            sums = self.shard.ridden("an all-reduce of the gradients' squared norms")
            computed = [s.sqrt().to(device=g.device, dtype=g.dtype) for s, g in zip(sums, grads)]
        else:
            computed = tensor_norms(grads)
        rest = iter(computed)
        total = total_norm([n if n is not None else next(rest) for n in streamed])
        coef = coefficient(total, self.max_norm)
        scale(grads, coef)
        self.stream.scale(coef)
        self.norm = total

    def stats(self) -> dict:
        """``grad_norm``: the global gradient norm of the last clipped step (one host read),
        None before one or without ``max_grad_norm``."""
        return dict(grad_norm=None if self.norm is None else float(self.norm))
