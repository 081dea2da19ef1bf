"""Scatter whole columns into many 2-D views in one launch (the apply of a host window).

Per param i: ``dst2ds[i][:, idxs[i]] = srcs[i]`` (cast to the destination's dtype), as
:func:`columns.scatter_columns_ref` does for one; see :func:`scatter_columns_multi_ref`.

Triton kernel -> launcher :func:`scatter_columns_multi` (one launch per pair of destination
dtype and source dtype; a table row per param, see ``_multi``) -> torch reference. Pure data
movement: bit for bit what the single-param kernel and the reference give.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _launch, _multi
from .columns import _check_idx, cast_rtne, column_tile, scatter_columns_ref

try:
    import triton
    import triton.language as tl
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e

_W = 9  # dst, idx, src addresses; rows, k; dst row/col strides; src row/col strides


# The *_like pointers give only element types: their addresses (the first tensor's) must
# not make variants (a misaligned first param would compile another).
@triton.jit(do_not_specialize=["n_tensors", "dst_like_ptr", "src_like_ptr"])
def _scatter_columns_multi_kernel(
    meta_ptr, cum_ptr, n_tensors,
    dst_like_ptr, src_like_ptr,  # the element types of this launch's destinations and sources
    W: tl.constexpr, SEARCH: tl.constexpr,
    SOFT_BF16: tl.constexpr,  # see columns.cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i, t = _multi.tensor_of(tl.program_id(0).to(tl.int64), cum_ptr, n_tensors, SEARCH)
    row = meta_ptr + i * W
    rows = tl.load(row + 3)
    k = tl.load(row + 4)
    idx_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    offs_r, offs_k, cols, mask = column_tile(t, rows, k, idx_ptr, BLOCK_R, BLOCK_K)
    src_ptr = tl.load(row + 2).to(tl.pointer_type(src_like_ptr.dtype.element_ty))
    dst_ptr = tl.load(row + 0).to(tl.pointer_type(dst_like_ptr.dtype.element_ty))
    x = tl.load(src_ptr + offs_r[:, None] * tl.load(row + 7)
                + (offs_k * tl.load(row + 8))[None, :], mask=mask)
    tl.store(dst_ptr + offs_r[:, None] * tl.load(row + 5) + (cols * tl.load(row + 6))[None, :],
             cast_rtne(x, dst_like_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


def scatter_columns_multi(dst2ds: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor],
                          srcs: Sequence[torch.Tensor]) -> int:
    """Triton launcher; same contract as :func:`scatter_columns_multi_ref`. Returns the number
    of launches (one per dtype pair and device that has work)."""
    _launch.require_triton(triton)
    if not len(dst2ds) == len(idxs) == len(srcs):
        raise ValueError("scatter_columns_multi: dst2ds, idxs and srcs need one entry each")
    groups: dict[tuple, list[int]] = {}
    for i, (dst, idx, src) in enumerate(zip(dst2ds, idxs, srcs)):
        if dst.dim() != 2:
            raise ValueError(f"dst2ds[{i}] must be 2-D, got shape {tuple(dst.shape)}")
        _check_idx(idx, dst.device, int64_only=True)
        if tuple(src.shape) != (dst.shape[0], idx.numel()) or src.device != dst.device:
            raise ValueError(f"srcs[{i}] must have shape [{dst.shape[0]}, {idx.numel()}] on "
                             f"{dst.device}, got {tuple(src.shape)} on {src.device}")
        if idx.numel() and dst.shape[0]:
            groups.setdefault((dst.device, dst.dtype, src.dtype), []).append(i)
    for (device, _, _), members in groups.items():
        # Tiles by the destinations' shapes, not by how many columns move (which varies
        # from one reselection to the next and would compile a new variant each time).
        block_r, block_k, num_warps = _launch.tile_2d(max(dst2ds[i].shape[0] for i in members),
                                                      max(dst2ds[i].shape[1] for i in members))
        meta, tiles = [], []
        for i in members:
            dst, idx, src = dst2ds[i], idxs[i], srcs[i]
            rows, k = dst.shape[0], idx.numel()
            meta.append([dst.data_ptr(), idx.data_ptr(), src.data_ptr(), rows, k,
                         dst.stride(0), dst.stride(1), src.stride(0), src.stride(1)])
            tiles.append(_launch.cdiv(rows, block_r) * _launch.cdiv(k, block_k))
        total, tabs = _multi.tables(meta, tiles, device)
        first = members[0]
        with _launch.launching(_scatter_columns_multi_kernel, dst2ds[first]):
            _scatter_columns_multi_kernel[(total,)](
                *tabs, len(members), dst2ds[first], srcs[first],
                W=_W, SEARCH=_multi.search_steps(len(members)), SOFT_BF16=_launch.interpreting(),
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps,
            )
    return len(groups)


def scatter_columns_multi_ref(dst2ds: Sequence[torch.Tensor], idxs: Sequence[torch.Tensor],
                              srcs: Sequence[torch.Tensor]) -> int:
    """The contract: :func:`scatter_columns_ref` per param. Returns 0 (no kernel launches)."""
    for dst, idx, src in zip(dst2ds, idxs, srcs):
        scatter_columns_ref(dst, idx, src)
    return 0
