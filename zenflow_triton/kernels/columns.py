"""Gather and scatter of whole columns of a 2-D view (migration, apply of host results).

Triton kernels -> launchers :func:`gather_columns` / :func:`scatter_columns` -> torch
references :func:`gather_columns_ref` / :func:`scatter_columns_ref` (the contract).
Also home of :func:`cast_rtne`, the cast every kernel that writes low precision uses.
"""

from __future__ import annotations

import torch

from . import _launch

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as e:  # no Triton: the references below still work
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit
def cast_rtne(x, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even, as torch's ``.to()`` does.

    SOFT_BF16 (constexpr: chosen per launch, compiled away on GPUs): Triton's CPU interpreter
    truncates fp32 -> bf16 casts where GPUs round to nearest even, so under the interpreter
    the rounding is done with integer ops; the CPU tests then check the GPU's numerics.
    """
    if SOFT_BF16 and DTYPE == tl.bfloat16 and x.dtype != tl.bfloat16:
        x = x.to(tl.float32)  # exact from fp16
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)  # add half an ulp, ties to even
        # NaN: keep sign, force the quiet bit (a low payload must not become inf).
        bits = tl.where(x != x, (bits >> 16) | 0x40, rounded >> 16)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def column_tile(pid, rows, k, idx_ptr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile of program ``pid`` in a 1-D grid over [rows, k] (k fastest, so neighbouring
    programs share rows): row offsets, compact column offsets, the selected column indices
    ``idx[offs_k]`` (all int64, so products with strides need no cast) and the in-bounds
    mask. Every column kernel starts with this."""
    pid = pid.to(tl.int64)  # every index below in int64: a param may pass 2**31 elements
    k_blocks = tl.cdiv(k, BLOCK_K)
    offs_r = (pid // k_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = (pid % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k
    mask = (offs_r < rows)[:, None] & mask_k[None, :]
    cols = tl.load(idx_ptr + offs_k, mask=mask_k, other=0).to(tl.int64)
    return offs_r, offs_k, cols, mask


@triton.jit(do_not_specialize=["k"])  # k: how many columns move, varies
def _gather_columns_kernel(
    src_ptr, idx_ptr, out_ptr,
    rows, k, stride_sr, stride_sc,
    SOFT_BF16: tl.constexpr,  # see cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # out[r, j] = src[r, idx[j]]; out is contiguous [rows, k]. 1-D grid, k fastest.
    offs_r, offs_k, cols, mask = column_tile(tl.program_id(0), rows, k, idx_ptr,
                                             BLOCK_R, BLOCK_K)
    x = tl.load(src_ptr + offs_r[:, None] * stride_sr + (cols * stride_sc)[None, :], mask=mask)
    tl.store(out_ptr + offs_r[:, None] * k + offs_k[None, :],
             cast_rtne(x, out_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit(do_not_specialize=["k", "stride_sr"])  # src is [rows, k]: its row stride is k
def _scatter_columns_kernel(
    dst_ptr, idx_ptr, src_ptr,
    rows, k, stride_dr, stride_dc, stride_sr, stride_sc,
    SOFT_BF16: tl.constexpr,  # see cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dst[r, idx[j]] = src[r, j]. 1-D grid, k fastest.
    offs_r, offs_k, cols, mask = column_tile(tl.program_id(0), rows, k, idx_ptr,
                                             BLOCK_R, BLOCK_K)
    x = tl.load(src_ptr + offs_r[:, None] * stride_sr + (offs_k * stride_sc)[None, :],
                mask=mask)
    tl.store(dst_ptr + offs_r[:, None] * stride_dr + (cols * stride_dc)[None, :],
             cast_rtne(x, dst_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def _check_idx(idx: torch.Tensor, device: torch.device, int64_only: bool = False) -> None:
    """``int64_only``: for the multi-tensor kernels, which read every index table entry
    through an int64 pointer (an int32 index would be read as garbage)."""
    allowed = (torch.int64,) if int64_only else (torch.int64, torch.int32)
    if idx.dim() != 1 or idx.dtype not in allowed or idx.device != device:
        raise ValueError(f"idx must be a 1-D {'int64' if int64_only else 'int64/int32'} "
                         f"tensor on {device}, got {idx.dtype} {tuple(idx.shape)} on "
                         f"{idx.device}")


def gather_columns(src2d: torch.Tensor, idx: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """Triton launcher; same contract as :func:`gather_columns_ref`. ``src2d`` may be strided."""
    _launch.require_triton(triton)
    if src2d.dim() != 2:
        raise ValueError(f"src2d must be 2-D, got shape {tuple(src2d.shape)}")
    _check_idx(idx, src2d.device)
    rows, k = src2d.shape[0], idx.numel()
    out = torch.empty(rows, k, dtype=dtype or src2d.dtype, device=src2d.device)
    if rows == 0 or k == 0:
        return out
    block_r, block_k, num_warps = _launch.tile_2d(rows, src2d.shape[1])  # by shape, not k
    grid = (_launch.cdiv(rows, block_r) * _launch.cdiv(k, block_k),)
    with _launch.launching(_gather_columns_kernel, src2d):
        wrap_triton(_gather_columns_kernel)[grid](
            src2d, idx, out, rows, k, src2d.stride(0), src2d.stride(1),
            SOFT_BF16=_launch.interpreting(), BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=num_warps,
        )
    return out


def scatter_columns(dst2d: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """Triton launcher; same contract as :func:`scatter_columns_ref`. Both may be strided."""
    _launch.require_triton(triton)
    if dst2d.dim() != 2:
        raise ValueError(f"dst2d must be 2-D, got shape {tuple(dst2d.shape)}")
    _check_idx(idx, dst2d.device)
    rows, k = dst2d.shape[0], idx.numel()
    if k == 0:
        return
    if tuple(src.shape) != (rows, k):
        raise ValueError(f"src must have shape [{rows}, {k}], got {tuple(src.shape)}")
    if rows == 0:
        return
    block_r, block_k, num_warps = _launch.tile_2d(rows, dst2d.shape[1])  # by shape, not k
    grid = (_launch.cdiv(rows, block_r) * _launch.cdiv(k, block_k),)
    with _launch.launching(_scatter_columns_kernel, dst2d):
        wrap_triton(_scatter_columns_kernel)[grid](
            dst2d, idx, src, rows, k, dst2d.stride(0), dst2d.stride(1),
            src.stride(0), src.stride(1),
            SOFT_BF16=_launch.interpreting(), BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=num_warps,
        )


def gather_columns_ref(src2d: torch.Tensor, idx: torch.Tensor,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new contiguous [rows, len(idx)] tensor (cast to ``dtype`` when given)."""
    out = src2d.index_select(1, idx)
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


def scatter_columns_ref(dst2d: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst2d[:, idx] = src (cast to dst2d's dtype); other columns untouched."""
    if idx.numel() == 0:
        return
    if idx.numel() == dst2d.shape[1]:  # sorted, unique, every column: a plain copy
        dst2d.copy_(src)
        return
    dst2d.index_copy_(1, idx, src.to(dst2d.dtype))
