"""The Triton backend: :data:`TRITON_OPS`, the launchers registered as ``torch.library`` ops.

Importing this module raises ImportError when Triton is missing, which
``kernels.triton_available()`` reports as "backend unavailable".

Every op is a ``torch.library.triton_op`` (namespace ``zenflow_triton``) whose body is the
per-op launcher, and every kernel launch inside goes through ``wrap_triton``, so
``torch.compile`` sees the kernels (and can trace through them with ``fullgraph=True``)
instead of an opaque call. ``mutates_args`` names every tensor written in place.

The fields of :data:`TRITON_OPS` are thin wrappers with exactly the signatures of the torch
references in ``TORCH_OPS``: they do the host-side arithmetic (bias corrections in Python
floats, as torch's AdamW does) and call the registered ops. The hyperparameters travel as
runtime float arguments, never as constexprs: an LR schedule does not recompile a kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import triton  # noqa: F401  (ImportError here = backend unavailable)
import torch
from torch.library import triton_op

from .ops import KernelOps
from .accumulate import accumulate_columns as _accumulate_columns_launch
from .adamw import adamw_scalars_launch as _adamw_launch
from .column_scores import column_scores as _column_scores_launch
from .columns import gather_columns as _gather_columns_launch
from .columns import scatter_columns as _scatter_columns_launch
from .adamw import adamw_multi as _adamw_multi
from .selective_adamw import adamw_scalars
from .scatter_multi import scatter_columns_multi as _scatter_columns_multi
from .selective_adamw_multi import \
    selective_adamw_accumulate as _selective_adamw_accumulate_multi
from .selective_adamw import selective_adamw_scalars as _selective_adamw_launch

NAMESPACE = "zenflow_triton"


# --- registered ops (schemas inferred from the annotations) --------------------------------

@triton_op(f"{NAMESPACE}::column_scores", mutates_args=())
def _column_scores_op(g2d: torch.Tensor, norm: str) -> torch.Tensor:
    return _column_scores_launch(g2d, norm, None)


# A custom op may not return an alias of an input, so "add into out" is its own op.
@triton_op(f"{NAMESPACE}::column_scores_add_", mutates_args={"out"})
def _column_scores_add_op(g2d: torch.Tensor, norm: str, out: torch.Tensor) -> None:
    _column_scores_launch(g2d, norm, out)


@triton_op(f"{NAMESPACE}::selective_adamw_", mutates_args={"p2d", "m", "v", "master"})
def _selective_adamw_op(p2d: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                        m: torch.Tensor, v: torch.Tensor, master: Optional[torch.Tensor],
                        decay: float, lerp_w: float, beta2: float, one_minus_beta2: float,
                        eps: float, neg_step_size: float, bc2_sqrt: float) -> None:
    _selective_adamw_launch(p2d, g2d, idx, m, v, master, decay=decay, lerp_w=lerp_w,
                            beta2=beta2, one_minus_beta2=one_minus_beta2, eps=eps,
                            neg_step_size=neg_step_size, bc2_sqrt=bc2_sqrt)


@triton_op(f"{NAMESPACE}::adamw_", mutates_args={"params", "ms", "vs", "masters"})
def _adamw_op(params: list[torch.Tensor], grads: list[torch.Tensor], ms: list[torch.Tensor],
              vs: list[torch.Tensor], masters: list[Optional[torch.Tensor]], decay: float,
              lerp_w: float, beta2: float, one_minus_beta2: float, eps: float,
              neg_step_sizes: list[float], bc2_sqrts: list[float]) -> None:
    _adamw_launch(params, grads, ms, vs, masters, decay, lerp_w, beta2, one_minus_beta2, eps,
                  neg_step_sizes, bc2_sqrts)


@triton_op(f"{NAMESPACE}::accumulate_columns_", mutates_args={"acc"})
def _accumulate_columns_op(acc: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                           scale: float) -> None:
    _accumulate_columns_launch(acc, g2d, idx, scale)


@triton_op(f"{NAMESPACE}::gather_columns", mutates_args=())
def _gather_columns_op(src2d: torch.Tensor, idx: torch.Tensor,
                       dtype: Optional[torch.dtype]) -> torch.Tensor:
    return _gather_columns_launch(src2d, idx, dtype)


@triton_op(f"{NAMESPACE}::scatter_columns_", mutates_args={"dst2d"})
def _scatter_columns_op(dst2d: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    _scatter_columns_launch(dst2d, idx, src)


# --- the KernelOps fields: the references' signatures ---------------------------------------

def column_scores(g2d: torch.Tensor, norm: str = "l2",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return torch.ops.zenflow_triton.column_scores(g2d, norm)
    torch.ops.zenflow_triton.column_scores_add_(g2d, norm, out)
    return out


def selective_adamw(p2d: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                    m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None, *,
                    lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int) -> None:
    if idx.numel() == 0:
        return
    s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, step)
    torch.ops.zenflow_triton.selective_adamw_(
        p2d, g2d, idx, m, v, master, s["decay"], s["lerp_w"], s["beta2"],
        s["one_minus_beta2"], s["eps"], s["neg_step_size"], s["bc2_sqrt"])


def adamw(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
          ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
          masters: Sequence[torch.Tensor | None], steps: Sequence[int], *,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
          skip: torch.Tensor | None = None) -> None:
    if len(params) == 0:
        return
    if not torch.compiler.is_compiling():  # eager: one multi-tensor launch per dtype pair
        _adamw_multi(params, grads, ms, vs, masters, steps, lr=lr, beta1=beta1, beta2=beta2,
                     eps=eps, weight_decay=weight_decay, skip=skip)
        return
    if skip is not None and bool(skip):  # the per-param ops have no flag: read it
        return
    # Under torch.compile: the registered op (a table of addresses cannot be traced).
    scal = [adamw_scalars(lr, beta1, beta2, eps, weight_decay, s) for s in steps]
    if len(scal) != len(params):
        raise ValueError(f"adamw: {len(params)} params but {len(scal)} steps")
    s0 = scal[0]
    torch.ops.zenflow_triton.adamw_(
        list(params), list(grads), list(ms), list(vs), list(masters), s0["decay"],
        s0["lerp_w"], s0["beta2"], s0["one_minus_beta2"], s0["eps"],
        [s["neg_step_size"] for s in scal], [s["bc2_sqrt"] for s in scal])


def selective_adamw_accumulate(p2ds, g2ds, dev_idxs, ms, vs, masters, steps, accs, host_idxs,
                               *, lr: float, beta1: float, beta2: float, eps: float,
                               weight_decay: float, skip: torch.Tensor | None = None) -> None:
    """Eager: one multi-tensor launch per dtype pair, masked on the device by ``skip``. Under
    torch.compile: the registered per-param ops (a table of addresses cannot be traced),
    which read ``skip`` on the host."""
    if not torch.compiler.is_compiling():
        _selective_adamw_accumulate_multi(p2ds, g2ds, dev_idxs, ms, vs, masters, steps, accs,
                                          host_idxs, lr=lr, beta1=beta1, beta2=beta2,
                                          eps=eps, weight_decay=weight_decay, skip=skip)
        return
    if skip is not None and bool(skip):
        return
    if any(g.shape[1] != p.shape[1] for p, g in zip(p2ds, g2ds)):
        raise NotImplementedError("a compact gradient (gradient streaming) is not supported "
                                  "under torch.compile; the optimizer's step is not compiled")
    for i in range(len(p2ds)):
        selective_adamw(p2ds[i], g2ds[i], dev_idxs[i], ms[i], vs[i], masters[i], lr=lr,
                        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                        step=steps[i])
        if accs[i] is not None and host_idxs[i] is not None:
            accumulate_columns(accs[i], g2ds[i], host_idxs[i], 1.0)


def accumulate_columns(acc: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                       scale: float = 1.0) -> None:
    if idx.numel() == 0:
        return
    torch.ops.zenflow_triton.accumulate_columns_(acc, g2d, idx, float(scale))


def gather_columns(src2d: torch.Tensor, idx: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.ops.zenflow_triton.gather_columns(src2d, idx, dtype)


def scatter_columns(dst2d: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    if idx.numel() == 0:
        return
    torch.ops.zenflow_triton.scatter_columns_(dst2d, idx, src)


def scatter_columns_multi(dst2ds, idxs, srcs) -> None:
    """Eager: one multi-tensor launch per dtype pair. Under torch.compile: the registered
    per-param op."""
    if not torch.compiler.is_compiling():
        _scatter_columns_multi(dst2ds, idxs, srcs)
        return
    for dst, idx, src in zip(dst2ds, idxs, srcs):
        scatter_columns(dst, idx, src)


TRITON_OPS = KernelOps(
    name="triton",
    column_scores=column_scores,
    selective_adamw=selective_adamw,
    selective_adamw_accumulate=selective_adamw_accumulate,
    adamw=adamw,
    accumulate_columns=accumulate_columns,
    gather_columns=gather_columns,
    scatter_columns=scatter_columns,
    scatter_columns_multi=scatter_columns_multi,
)
