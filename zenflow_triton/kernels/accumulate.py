"""Accumulate the gradient of host-owned columns: acc += scale * g2d[:, idx] in fp32.

``acc`` fp32 or bf16 [rows, n] (compact, host-owned columns only; a bf16 sum is rounded to
nearest after each add, as torch's ``acc.add_`` does), ``idx`` [n] sorted int64.

Triton kernel -> launcher :func:`accumulate_columns` -> torch reference
:func:`accumulate_columns_ref` (the contract).
"""

from __future__ import annotations

import torch

from . import _launch
from .columns import _check_idx, cast_rtne, column_tile

ACC_DTYPES = (torch.float32, torch.bfloat16)

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit(do_not_specialize=["n"])  # n: the host columns' count, varies
def _accumulate_columns_kernel(
    acc_ptr, g_ptr, idx_ptr,
    rows, n, stride_ar, stride_ac, stride_gr, stride_gc,
    scale,  # runtime fp32 (a window's 1/update_interval changes with the config, not the code)
    SOFT_BF16: tl.constexpr,  # see columns.cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # acc[r, j] += scale * g[r, idx[j]] in fp32, stored in acc's dtype (fp32 or bf16, rounded
    # to nearest). 1-D grid over [rows, n] tiles, n fastest.
    offs_r, offs_k, cols, mask = column_tile(tl.program_id(0), rows, n, idx_ptr,
                                             BLOCK_R, BLOCK_K)
    g = tl.load(g_ptr + offs_r[:, None] * stride_gr + (cols * stride_gc)[None, :],
                mask=mask, other=0.0).to(tl.float32)
    acc_ptrs = acc_ptr + offs_r[:, None] * stride_ar + (offs_k * stride_ac)[None, :]
    acc = tl.load(acc_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(acc_ptrs, cast_rtne(acc + scale * g, acc_ptrs.dtype.element_ty, SOFT_BF16),
             mask=mask)  # scale 1.0 is exact: same as acc + g


def accumulate_columns(acc: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                       scale: float = 1.0) -> None:
    """Triton launcher; same contract as :func:`accumulate_columns_ref`. Both may be strided."""
    _launch.require_triton(triton)
    n = idx.numel()
    if n == 0:
        return
    if (g2d.dim() != 2 or acc.dtype not in ACC_DTYPES
            or tuple(acc.shape) != (g2d.shape[0], n)):
        raise ValueError(f"acc must be fp32 or bf16 [{g2d.shape[0] if g2d.dim() else '?'}, "
                         f"{n}] and "
                         f"g2d 2-D, got acc {acc.dtype} {tuple(acc.shape)}, "
                         f"g2d {tuple(g2d.shape)}")
    _check_idx(idx, g2d.device)
    rows = g2d.shape[0]
    if rows == 0:
        return
    block_r, block_k, num_warps = _launch.tile_2d(rows, g2d.shape[1])  # by shape, not n
    grid = (_launch.cdiv(rows, block_r) * _launch.cdiv(n, block_k),)
    with _launch.launching(_accumulate_columns_kernel, acc):
        wrap_triton(_accumulate_columns_kernel)[grid](
            acc, g2d, idx, rows, n, acc.stride(0), acc.stride(1), g2d.stride(0), g2d.stride(1),
            float(scale), SOFT_BF16=_launch.interpreting(), BLOCK_R=block_r,
            BLOCK_K=block_k, num_warps=num_warps,
        )


def accumulate_columns_ref(acc: torch.Tensor, g2d: torch.Tensor, idx: torch.Tensor,
                           scale: float = 1.0) -> None:
    if idx.numel() == 0:
        return
    # idx is sorted and unique, so covering every column means idx == arange(cols).
    g = g2d if idx.numel() == g2d.shape[1] else g2d.index_select(1, idx)
    if scale == 1.0:
        acc.add_(g)
    else:
        acc.add_(g, alpha=scale)
