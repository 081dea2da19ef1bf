"""Fused selective AdamW: update columns ``idx`` of ``p`` from compact fp32 state, in place.

``p2d`` [rows, cols] (fp32/bf16/fp16), ``g2d`` [rows, cols], ``idx`` [k] sorted int64,
``m``, ``v`` fp32 [rows, k], ``master`` fp32 [rows, k] when ``p`` is low precision else None.

Triton kernel -> launcher :func:`selective_adamw_scalars` (takes the precomputed scalars of
:func:`adamw_scalars`; the registered op in ``triton_ops`` wraps it) -> torch reference
:func:`selective_adamw_ref` (the contract). One pass: gathers ``g[:, idx]`` (and
``p[:, idx]`` when there is no master), updates ``m, v`` and the weight in fp32, writes
them back and scatters the new weight into ``p[:, idx]`` in p's dtype.
"""

from __future__ import annotations

import torch

from . import _launch
from .columns import _check_idx, cast_rtne, column_tile
from ..adamw_math import adamw_, bias_corrections

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit
def _adamw_math(w, g, m, v, decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size,
                bc2_sqrt):
    """One AdamW update of fp32 blocks, op for op as ``adamw_math.adamw_`` (torch's order).

    All hyperparameters are runtime fp32 scalars, never constexpr: an LR scheduler changes
    lr (hence decay and step size) every step and must not trigger a recompilation.
    """
    w = w * decay
    # torch.lerp(m, g, wt): m + wt * (g - m) when |wt| < 0.5, else g - (g - m) * (1 - wt).
    if lerp_w < 0.5:
        m = m + lerp_w * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_w)
    v = v * beta2 + one_minus_beta2 * g * g
    # IEEE-rounded sqrt/div (tl.sqrt / "/" are approximate on GPUs); the kernel is memory
    # bound, so exact rounding is free and keeps the Triton and torch backends close.
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = w + tl.div_rn(neg_step_size * m, denom)
    return w, m, v


@triton.jit
def adamw_block(p_ptrs, g, m_ptrs, v_ptrs, master_ptrs, mask,
                decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
                HAS_MASTER: tl.constexpr, SOFT_BF16: tl.constexpr):
    """One AdamW update of a block, in place: load the fp32 state at ``m_ptrs``/``v_ptrs``
    and the weight (from ``master_ptrs``, or from ``p_ptrs`` when HAS_MASTER is false, which
    then never touches ``master_ptrs``), update with the fp32 gradient block ``g``, store
    the state back and the weight into ``p_ptrs`` in p's dtype. Every AdamW kernel (one
    param or many, columns or flat) goes through here, so they agree bit for bit."""
    m = tl.load(m_ptrs, mask=mask, other=0.0)
    v = tl.load(v_ptrs, mask=mask, other=0.0)
    if HAS_MASTER:
        w = tl.load(master_ptrs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
    w, m, v = _adamw_math(w, g, m, v, decay, lerp_w, beta2, one_minus_beta2, eps,
                          neg_step_size, bc2_sqrt)
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptrs, w, mask=mask)
    tl.store(p_ptrs, cast_rtne(w, p_ptrs.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit(do_not_specialize=["k"])
def _selective_adamw_kernel(
    p_ptr, g_ptr, idx_ptr, m_ptr, v_ptr, master_ptr,
    rows, k,
    stride_pr, stride_pc, stride_gr, stride_gc,
    decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
    HAS_MASTER: tl.constexpr,  # fp32 weight from master (low-precision p) or from p itself;
                               # also drops the master load/store when p is fp32
    SOFT_BF16: tl.constexpr,   # see columns.cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # 1-D grid over [rows/BLOCK_R, k/BLOCK_K] tiles, k fastest (neighbouring programs share
    # rows). The compact state m, v, master is contiguous [rows, k].
    offs_r, offs_k, cols, mask = column_tile(tl.program_id(0), rows, k, idx_ptr,
                                             BLOCK_R, BLOCK_K)
    state = offs_r[:, None] * k + offs_k[None, :]
    p_ptrs = p_ptr + offs_r[:, None] * stride_pr + (cols * stride_pc)[None, :]
    g = tl.load(g_ptr + offs_r[:, None] * stride_gr + (cols * stride_gc)[None, :],
                mask=mask, other=0.0).to(tl.float32)
    adamw_block(p_ptrs, g, m_ptr + state, v_ptr + state, master_ptr + state, mask,
                decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
                HAS_MASTER, SOFT_BF16)


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> dict[str, float]:
    """The kernels' runtime scalars, computed on the host in Python floats like torch does
    (bias corrections included), so the kernel never sees ``step`` or a power."""
    bc1, bc2_sqrt = bias_corrections(beta1, beta2, step)
    return dict(decay=1.0 - lr * weight_decay, lerp_w=1.0 - beta1, beta2=beta2,
                one_minus_beta2=1.0 - beta2, eps=eps, neg_step_size=-(lr / bc1),
                bc2_sqrt=bc2_sqrt)


def _check_state(name: str, t: torch.Tensor, rows: int, k: int, device,
                 dtypes: tuple = (torch.float32,)) -> None:
    if t.dtype not in dtypes or tuple(t.shape) != (rows, k) or not t.is_contiguous() \
            or t.device != device:
        kinds = " or ".join({torch.float32: "fp32", torch.bfloat16: "bf16"}[d] for d in dtypes)
        raise ValueError(f"{name} must be a contiguous {kinds} [{rows}, {k}] tensor on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} "
                         f"on {t.device}")


def selective_adamw_scalars(p2d: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                            m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None, *,
                            decay: float, lerp_w: float, beta2: float, one_minus_beta2: float,
                            eps: float, neg_step_size: float, bc2_sqrt: float) -> None:
    """Launcher taking the precomputed scalars of :func:`adamw_scalars` (the registered op's
    body). ``p2d`` and ``g2d`` may be strided views; the state must be contiguous."""
    _launch.require_triton(triton)
    k = idx.numel()
    if k == 0:
        return
    if p2d.dim() != 2 or g2d.shape != p2d.shape:
        raise ValueError(f"p2d and g2d must be 2-D of one shape, got {tuple(p2d.shape)} "
                         f"and {tuple(g2d.shape)}")
    _check_idx(idx, p2d.device)
    rows = p2d.shape[0]
    for name, t in (("m", m), ("v", v)) + ((("master", master),) if master is not None else ()):
        _check_state(name, t, rows, k, p2d.device)
    if rows == 0:
        return
    block_r, block_k, num_warps = _launch.tile_2d(rows, p2d.shape[1])  # by shape, not k
    grid = (_launch.cdiv(rows, block_r) * _launch.cdiv(k, block_k),)
    with _launch.launching(_selective_adamw_kernel, p2d):
        wrap_triton(_selective_adamw_kernel)[grid](
            p2d, g2d, idx, m, v, master if master is not None else m,  # dummy, never touched
            rows, k, p2d.stride(0), p2d.stride(1), g2d.stride(0), g2d.stride(1),
            decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
            HAS_MASTER=master is not None, SOFT_BF16=_launch.interpreting(),
            BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps,
        )


def selective_adamw_ref(p2d: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                        m: torch.Tensor, v: torch.Tensor, master: torch.Tensor | None, *,
                        lr: float, beta1: float, beta2: float, eps: float,
                        weight_decay: float, step: int, compact: bool = False) -> None:
    """``compact``: ``g2d`` is already the gradient of columns ``idx`` ([rows, k]: gradient
    streaming keeps only those on the device), not the whole gradient."""
    if idx.numel() == 0:
        return
    g = g2d.float() if compact else g2d.index_select(1, idx).float()
    w = master if master is not None else p2d.index_select(1, idx).float()
    adamw_(w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, step=step)
    p2d.index_copy_(1, idx, w.to(p2d.dtype))
