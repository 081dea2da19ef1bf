"""The device half of one step for many matrix params in one launch: AdamW on each param's
device-owned columns, and the gradient of its host-owned columns added to its window
accumulator, reading each gradient once.

Per param i (2-D views; see :func:`selective_adamw_accumulate_ref`, the contract):

* ``dev_idxs[i]`` [k] sorted int64: AdamW as :func:`selective_adamw_ref` with the compact
  fp32 state ``ms[i]``, ``vs[i]`` (and ``masters[i]`` for low-precision params), Adam step
  ``steps[i]``; skipped when k = 0;
* ``accs[i]`` fp32 [rows, n] with ``host_idxs[i]`` [n]: ``accs[i] += g[:, host_idxs[i]]``;
  skipped when ``accs[i]`` is None or n = 0.

``g2ds[i]`` is the whole gradient [rows, cols], or only its device-owned columns [rows, k]
(*compact*: gradient streaming keeps no more on the device; then nothing is accumulated, and
``accs[i]`` must be None). Where k = cols the two are the same tensor.

Triton kernel -> launcher :func:`selective_adamw_accumulate` (one launch per param dtype
and grad dtype; a table row per param, see ``_multi``) -> torch reference. The arithmetic
is the one of the single-param kernels (``selective_adamw.adamw_block``, the accumulate's
add), op for op, so a multi-tensor launch gives bit for bit what per-param launches give.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _launch, _multi
from .accumulate import ACC_DTYPES, accumulate_columns_ref
from .columns import _check_idx, cast_rtne, column_tile
from .selective_adamw import _check_state, adamw_block, adamw_scalars, selective_adamw_ref

try:
    import triton
    import triton.language as tl
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e

# Table row: addresses, then sizes and strides (int64), then the param's tile count.
(_P, _G, _DIDX, _M, _V, _MASTER, _ACC, _HIDX, _ROWS, _K, _N, _PSR, _PSC, _GSR, _GSC,
 _ADAM_TILES, _G_COMPACT) = range(17)
_W = 17


# The *_like pointers give only element types: their addresses (the first tensor's) must
# not make variants (a misaligned first param would compile another).
@triton.jit(do_not_specialize=["n_tensors", "p_like_ptr", "g_like_ptr"])
def _selective_adamw_accumulate_kernel(
    meta_ptr, cum_ptr, hyper_ptr, n_tensors,
    p_like_ptr, g_like_ptr,  # the element types of the params and grads of this launch
    skip_ptr,  # int32 [1], 0 or 1: 1 = a gradient of this window was not finite; write nothing
    decay, lerp_w, beta2, one_minus_beta2, eps,
    W: tl.constexpr, SEARCH: tl.constexpr,
    HAS_MASTER: tl.constexpr,  # low-precision params: the weight lives in the fp32 master
    ACC_BF16: tl.constexpr,    # the accumulators of this launch are bf16 (else fp32)
    SOFT_BF16: tl.constexpr,   # see columns.cast_rtne
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i, t = _multi.tensor_of(tl.program_id(0).to(tl.int64), cum_ptr, n_tensors, SEARCH)
    row = meta_ptr + i * W
    # A set skip flag (0 or 1) makes every tile empty: nothing is read or written.
    rows = tl.load(row + 8) * (1 - tl.load(skip_ptr))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(g_like_ptr.dtype.element_ty))
    g_sr = tl.load(row + 13)
    g_sc = tl.load(row + 14)
    adam_tiles = tl.load(row + 15)
    if t < adam_tiles:  # a tile of the device-owned columns: AdamW
        k = tl.load(row + 9)
        idx_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int64))
        offs_r, offs_k, cols, mask = column_tile(t, rows, k, idx_ptr, BLOCK_R, BLOCK_K)
        state = offs_r[:, None] * k + offs_k[None, :]
        p_ptr = tl.load(row + 0).to(tl.pointer_type(p_like_ptr.dtype.element_ty))
        p_ptrs = p_ptr + offs_r[:, None] * tl.load(row + 11) + (cols * tl.load(row + 12))[None, :]
        m_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        # Without a master the row holds 0 there; adamw_block then never touches it.
        master_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
        # A compact gradient holds only these columns, at their compact positions.
        g_cols = tl.where(tl.load(row + 16) != 0, offs_k.to(tl.int64), cols)
        g = tl.load(g_ptr + offs_r[:, None] * g_sr + (g_cols * g_sc)[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        adamw_block(p_ptrs, g, m_ptr + state, v_ptr + state, master_ptr + state, mask,
                    decay, lerp_w, beta2, one_minus_beta2, eps, tl.load(hyper_ptr + 2 * i),
                    tl.load(hyper_ptr + 2 * i + 1), HAS_MASTER, SOFT_BF16)
    else:  # a tile of the host-owned columns: acc += g[:, host_idx]
        n = tl.load(row + 10)
        idx_ptr = tl.load(row + 7).to(tl.pointer_type(tl.int64))
        offs_r, offs_k, cols, mask = column_tile(t - adam_tiles, rows, n, idx_ptr,
                                                 BLOCK_R, BLOCK_K)
        g = tl.load(g_ptr + offs_r[:, None] * g_sr + (cols * g_sc)[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        acc_at = offs_r[:, None] * n + offs_k[None, :]
        if ACC_BF16:  # as accumulate_columns at scale 1.0: an fp32 add, rounded to nearest
            acc_ptrs = tl.load(row + 6).to(tl.pointer_type(tl.bfloat16)) + acc_at
            acc = tl.load(acc_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(acc_ptrs, cast_rtne(acc + 1.0 * g, tl.bfloat16, SOFT_BF16), mask=mask)
        else:
            acc_ptrs = tl.load(row + 6).to(tl.pointer_type(tl.float32)) + acc_at
            acc = tl.load(acc_ptrs, mask=mask, other=0.0)
            tl.store(acc_ptrs, acc + 1.0 * g, mask=mask)  # as accumulate_columns at 1.0


def selective_adamw_accumulate(p2ds: Sequence[torch.Tensor], g2ds: Sequence[torch.Tensor],
                               dev_idxs: Sequence[torch.Tensor], ms: Sequence[torch.Tensor],
                               vs: Sequence[torch.Tensor],
                               masters: Sequence[torch.Tensor | None], steps: Sequence[int],
                               accs: Sequence[torch.Tensor | None],
                               host_idxs: Sequence[torch.Tensor | None], *, lr: float,
                               beta1: float, beta2: float, eps: float,
                               weight_decay: float, skip: torch.Tensor | None = None) -> int:
    """Triton launcher; same contract as :func:`selective_adamw_accumulate_ref`. Returns the
    number of kernel launches (one per pair of param dtype and grad dtype that has work).
    ``skip``: an int32 [1] flag on the params' device, read by the kernel (no host sync)."""
    _launch.require_triton(triton)
    n_t = len(p2ds)
    if not (len(g2ds) == len(dev_idxs) == len(ms) == len(vs) == len(masters) == len(steps)
            == len(accs) == len(host_idxs) == n_t):
        raise ValueError("selective_adamw_accumulate: every list needs one entry per param")
    groups: dict[tuple, list[int]] = {}
    for i in range(n_t):
        p, g = p2ds[i], g2ds[i]
        rows, k = p.shape[0], dev_idxs[i].numel()
        if p.dim() != 2 or g.dim() != 2 or g.shape[0] != rows or g.device != p.device or \
                g.shape[1] not in (p.shape[1], k):
            raise ValueError(f"param {i}: p2d and g2d must be 2-D on one device, g2d of p2d's "
                             f"shape or of its {k} device-owned columns, got {tuple(p.shape)} "
                             f"and {tuple(g.shape)}")
        if _compact(p, g) and accs[i] is not None and host_idxs[i] is not None \
                and host_idxs[i].numel():
            raise ValueError(f"param {i}: a compact gradient (its device-owned columns only) "
                             "has no host-owned columns to accumulate")
        _check_idx(dev_idxs[i], p.device, int64_only=True)
        if k:
            for name, t in ((("m", ms[i]), ("v", vs[i]))
                            + ((("master", masters[i]),) if masters[i] is not None else ())):
                _check_state(f"{name}[{i}]", t, rows, k, p.device)
            if (masters[i] is not None) != (p.dtype != torch.float32):
                raise ValueError(f"param {i}: a {p.dtype} param needs "
                                 f"{'an fp32 master' if p.dtype != torch.float32 else 'no master'}")
        if accs[i] is not None and host_idxs[i] is not None and host_idxs[i].numel():
            _check_idx(host_idxs[i], p.device, int64_only=True)
            _check_state(f"acc[{i}]", accs[i], rows, host_idxs[i].numel(), p.device,
                         ACC_DTYPES)
        groups.setdefault((p.device, p.dtype, g.dtype), []).append(i)
    launches = 0
    for (device, p_dtype, _), members in list(groups.items()):
        # One launch per accumulator dtype; a param with nothing to accumulate joins the first.
        by_acc: dict[torch.dtype, list[int]] = {}
        for i in members:
            has_acc = accs[i] is not None and host_idxs[i] is not None and host_idxs[i].numel()
            by_acc.setdefault(accs[i].dtype if has_acc else None, []).append(i)
        loose = by_acc.pop(None, [])
        if not by_acc:
            by_acc[torch.float32] = []
        by_acc[next(iter(by_acc))] += loose
        for acc_dtype, sub in by_acc.items():
            launches += _launch_group(sorted(sub), p2ds, g2ds, dev_idxs, ms, vs, masters,
                                      steps, accs, host_idxs, device, p_dtype != torch.float32,
                                      acc_dtype == torch.bfloat16, skip,
                                      lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay)
    return launches


def _launch_group(members, p2ds, g2ds, dev_idxs, ms, vs, masters, steps, accs, host_idxs,
                  device, has_master, acc_bf16, skip, *, lr, beta1, beta2, eps,
                  weight_decay) -> int:
    max_rows = max(p2ds[i].shape[0] for i in members)
    max_cols = max(p2ds[i].shape[1] for i in members)
    block_r, block_k, num_warps = _launch.tile_2d(max_rows, max_cols)
    rows_meta, hyper, tiles, order = [], [], [], []
    s0 = None
    for i in members:
        p, g = p2ds[i], g2ds[i]
        rows = p.shape[0]
        k = dev_idxs[i].numel()
        acc, hidx = accs[i], host_idxs[i]
        n = hidx.numel() if acc is not None and hidx is not None else 0
        adam_tiles = _launch.cdiv(rows, block_r) * _launch.cdiv(k, block_k) if rows else 0
        acc_tiles = _launch.cdiv(rows, block_r) * _launch.cdiv(n, block_k) if rows else 0
        if adam_tiles + acc_tiles == 0:
            continue
        s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, steps[i] if k else 1)
        s0 = s0 or s
        row = [0] * _W
        row[_P], row[_G] = p.data_ptr(), g.data_ptr()
        if k:
            row[_DIDX], row[_M], row[_V] = (dev_idxs[i].data_ptr(), ms[i].data_ptr(),
                                           vs[i].data_ptr())
            if masters[i] is not None:
                row[_MASTER] = masters[i].data_ptr()
        if n:
            row[_ACC], row[_HIDX] = acc.data_ptr(), hidx.data_ptr()
        row[_ROWS], row[_K], row[_N] = rows, k, n
        row[_PSR], row[_PSC] = p.stride(0), p.stride(1)
        row[_GSR], row[_GSC] = g.stride(0), g.stride(1)
        row[_ADAM_TILES] = adam_tiles
        row[_G_COMPACT] = int(_compact(p, g))
        rows_meta.append(row)
        hyper.extend((s["neg_step_size"], s["bc2_sqrt"]))
        tiles.append(adam_tiles + acc_tiles)
        order.append(i)
    if not order:
        return 0
    total, tabs = _multi.tables(rows_meta, tiles, device, hyper)
    first = order[0]
    with _launch.launching(_selective_adamw_accumulate_kernel, p2ds[first]):
        _selective_adamw_accumulate_kernel[(total,)](
            *tabs, len(order), p2ds[first], g2ds[first], _launch.skip_flag(skip, device),
            s0["decay"], s0["lerp_w"], s0["beta2"], s0["one_minus_beta2"], s0["eps"],
            W=_W, SEARCH=_multi.search_steps(len(order)), HAS_MASTER=has_master,
            ACC_BF16=acc_bf16, SOFT_BF16=_launch.interpreting(), BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=num_warps,
        )
    return 1


def _compact(p2d: torch.Tensor, g2d: torch.Tensor) -> bool:
    """Whether ``g2d`` holds only the device-owned columns of ``p2d``'s gradient."""
    return g2d.shape[1] != p2d.shape[1]


def selective_adamw_accumulate_ref(p2ds, g2ds, dev_idxs, ms, vs, masters, steps, accs,
                                   host_idxs, *, lr: float, beta1: float, beta2: float,
                                   eps: float, weight_decay: float,
                                   skip: torch.Tensor | None = None) -> int:
    """The contract: per param, :func:`selective_adamw_ref` on the device-owned columns, then
    :func:`accumulate_columns_ref` of the host-owned ones; nothing at all when ``skip`` (an
    int32 [1] flag) is nonzero (this reference reads it on the host). Returns 0 (no kernel
    launches)."""
    if skip is not None and bool(skip):
        return 0
    for i in range(len(p2ds)):
        if dev_idxs[i].numel():
            selective_adamw_ref(p2ds[i], g2ds[i], dev_idxs[i], ms[i], vs[i], masters[i],
                                lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, step=steps[i],
                                compact=_compact(p2ds[i], g2ds[i]))
        if accs[i] is not None and host_idxs[i] is not None and host_idxs[i].numel():
            accumulate_columns_ref(accs[i], g2ds[i], host_idxs[i], 1.0)
    return 0
