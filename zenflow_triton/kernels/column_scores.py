"""Column importance of a 2-D gradient view: score[j] = sum_i g[i, j]**2 (or |g[i, j]|).

Triton kernel -> launcher :func:`column_scores` -> torch reference :func:`column_scores_ref`
(the contract). One pass over ``g`` in its own dtype, fp32 accumulation.
"""

from __future__ import annotations

import torch

from . import _launch

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit
def _column_scores_kernel(
    g_ptr, out_ptr,
    rows, cols, rows_per_split,
    stride_gr, stride_gc,
    L1: tl.constexpr,          # |g| instead of g**2: a different op in the inner loop
    ACCUMULATE: tl.constexpr,  # add into out (caller's running scores) instead of overwriting:
                               # spares a load when there is nothing to add to
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Program (col block, row split): sums rows [split * rows_per_split, +rows_per_split)
    # of BLOCK_C columns and writes row `split` of out ([splits, cols], or [cols] when 1).
    pid_c = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)  # split * rows_per_split: int64, as every index
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < cols
    col_off = offs_c.to(tl.int64) * stride_gc
    r_start = split * rows_per_split
    r_end = tl.minimum(r_start + rows_per_split, rows)

    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask = (offs_r < r_end)[:, None] & mask_c[None, :]
        ptrs = g_ptr + (offs_r * stride_gr)[:, None] + col_off[None, :]
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if L1:
            acc += tl.abs(g)
        else:
            acc += g * g
    s = tl.sum(acc, axis=0)

    out_ptrs = out_ptr + split * cols + offs_c
    if ACCUMULATE:
        s += tl.load(out_ptrs, mask=mask_c, other=0.0)
    tl.store(out_ptrs, s, mask=mask_c)


def column_scores(g2d: torch.Tensor, norm: str = "l2",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher; same contract as :func:`column_scores_ref`. ``g2d`` may be strided."""
    _launch.require_triton(triton)
    if norm not in ("l2", "l1"):
        raise ValueError(f"norm must be 'l2' or 'l1', got {norm!r}")
    if g2d.dim() != 2:
        raise ValueError(f"g2d must be 2-D, got shape {tuple(g2d.shape)}")
    rows, cols = g2d.shape
    if out is not None and (out.dtype != torch.float32 or out.shape != (cols,)
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous fp32 [{cols}] tensor, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if rows == 0 or cols == 0:
        return torch.zeros(cols, dtype=torch.float32, device=g2d.device) if out is None else out
    result = torch.empty(cols, dtype=torch.float32, device=g2d.device) if out is None else out

    block_r, block_c, num_warps = _launch.tile_2d(rows, cols)
    col_blocks = _launch.cdiv(cols, block_c)
    splits = _launch.row_splits(rows, block_r, col_blocks, g2d.device)
    rows_per_split = _launch.cdiv(_launch.cdiv(rows, block_r), splits) * block_r
    splits = _launch.cdiv(rows, rows_per_split)  # no empty trailing split
    if splits == 1:
        # One program per column block writes the final scores (into out when given).
        target, accumulate = result, out is not None
    else:
        target, accumulate = torch.empty(splits, cols, dtype=torch.float32,
                                         device=g2d.device), False
    with _launch.launching(_column_scores_kernel, g2d):
        wrap_triton(_column_scores_kernel)[(col_blocks, splits)](
            g2d, target, rows, cols, rows_per_split, g2d.stride(0), g2d.stride(1),
            L1=norm == "l1", ACCUMULATE=accumulate, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=num_warps,
        )
    if splits > 1:  # deterministic second pass over [splits, cols] partial sums
        if out is None:
            torch.sum(target, dim=0, out=result)
        else:
            result.add_(target.sum(dim=0))
    return result


def column_scores_ref(g2d: torch.Tensor, norm: str = "l2",
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores of shape [cols]; added into ``out`` (fp32, [cols]) when given, and returned."""
    g = g2d.float()
    s = g.square().sum(dim=0) if norm == "l2" else g.abs().sum(dim=0)
    if out is None:
        return s
    out.add_(s)
    return out
