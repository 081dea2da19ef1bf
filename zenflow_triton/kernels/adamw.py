"""Full AdamW for device-owned params (1-D and small), many tensors per call.

``params[i]`` any float dtype; ``masters[i]`` fp32 copy when params[i] is low precision else
None; ``ms``/``vs`` fp32; ``steps[i]`` the 1-based Adam step of params[i] after this update.

Triton kernel -> launcher :func:`adamw_scalars_launch` (the registered op in ``triton_ops``
wraps it) -> torch reference :func:`adamw_ref` (the contract).
Each tensor is treated as flat; the launcher runs one elementwise launch per tensor with
that tensor's bias corrections (computed on the host).
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _launch, _multi
from ..adamw_math import adamw_
from .selective_adamw import adamw_block

try:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton
except ImportError as e:  # no Triton: the reference below still works
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, master_ptr,
    n,
    decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
    HAS_MASTER: tl.constexpr,  # fp32 weight from master (low-precision p) or from p itself;
                               # also drops the master load/store when p is fp32
    SOFT_BF16: tl.constexpr,   # see columns.cast_rtne
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    adamw_block(p_ptr + offs, g, m_ptr + offs, v_ptr + offs, master_ptr + offs, mask,
                decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt,
                HAS_MASTER, SOFT_BF16)


# The *_like pointers give only element types: their addresses (the first tensor's) must
# not make variants (a misaligned first param would compile another).
@triton.jit(do_not_specialize=["n_tensors", "p_like_ptr", "g_like_ptr"])
def _adamw_multi_kernel(
    meta_ptr, cum_ptr, hyper_ptr, n_tensors,
    p_like_ptr, g_like_ptr,  # the element types of the params and grads of this launch
    skip_ptr,  # int32 [1], 0 or 1: 1 = a gradient of this window was not finite; write nothing
    decay, lerp_w, beta2, one_minus_beta2, eps,
    W: tl.constexpr, SEARCH: tl.constexpr,
    HAS_MASTER: tl.constexpr,  # as in _adamw_kernel
    SOFT_BF16: tl.constexpr,   # see columns.cast_rtne
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr = False,  # the host checked (_launch.vector_aligned): every
                                    # address 16-byte aligned, every numel a multiple of 8
):
    # _adamw_kernel over many flat tensors: a table row per tensor (p, g, m, v, master
    # addresses, numel), per-tensor step size and bias correction; see _multi.
    i, t = _multi.tensor_of(tl.program_id(0).to(tl.int64), cum_ptr, n_tensors, SEARCH)
    row = meta_ptr + i * W
    n = tl.load(row + 5) * (1 - tl.load(skip_ptr))  # a set skip flag: nothing in bounds
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_like_ptr.dtype.element_ty))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(g_like_ptr.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    # Without a master the row holds 0 there; adamw_block then never touches it.
    master_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    if ALIGNED:  # what a pointer argument's specialisation would say; a table value cannot
        n = tl.multiple_of(n, 8)  # _launch.ALIGN_ELEMENTS
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        master_ptr = tl.multiple_of(master_ptr, 16)
    offs = t * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    adamw_block(p_ptr + offs, g, m_ptr + offs, v_ptr + offs, master_ptr + offs, mask,
                decay, lerp_w, beta2, one_minus_beta2, eps, tl.load(hyper_ptr + 2 * i),
                tl.load(hyper_ptr + 2 * i + 1), HAS_MASTER, SOFT_BF16)


def _check(name: str, i: int, t: torch.Tensor, p: torch.Tensor, fp32: bool) -> None:
    if t.numel() != p.numel() or t.device != p.device or not t.is_contiguous() \
            or (fp32 and t.dtype != torch.float32):
        raise ValueError(
            f"{name}[{i}] must be a contiguous {'fp32 ' if fp32 else ''}tensor of "
            f"{p.numel()} elements on {p.device} (like params[{i}]), got {t.dtype} "
            f"{tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}")


def adamw_scalars_launch(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                         masters: Sequence[torch.Tensor | None], decay: float, lerp_w: float,
                         beta2: float, one_minus_beta2: float, eps: float,
                         neg_step_sizes: Sequence[float], bc2_sqrts: Sequence[float]) -> None:
    """Launcher taking precomputed scalars (per-tensor step size and bias correction): the
    registered op's body. State and params must be contiguous; a strided grad is copied."""
    _launch.require_triton(triton)
    n_t = len(params)
    if not (len(grads) == len(ms) == len(vs) == len(masters) == len(neg_step_sizes)
            == len(bc2_sqrts) == n_t):
        raise ValueError("adamw: params, grads, ms, vs, masters and steps must have one length")
    soft_bf16 = _launch.interpreting()
    for i in range(n_t):
        p, g, m, v, master = params[i], grads[i], ms[i], vs[i], masters[i]
        _check("params", i, p, p, fp32=False)
        for name, t in (("ms", m), ("vs", v)) + ((("masters", master),) if master is not None
                                                 else ()):
            _check(name, i, t, p, fp32=True)
        if g.numel() != p.numel():
            raise ValueError(f"grads[{i}] has {g.numel()} elements, params[{i}] {p.numel()}")
        n = p.numel()
        if n == 0:
            continue
        g = g.contiguous()
        block, num_warps = _launch.block_1d(n)
        with _launch.launching(_adamw_kernel, p):
            wrap_triton(_adamw_kernel)[(_launch.cdiv(n, block),)](
                p, g, m, v, master if master is not None else m,  # dummy, never touched
                n, decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_sizes[i], bc2_sqrts[i],
                HAS_MASTER=master is not None, SOFT_BF16=soft_bf16, BLOCK=block,
                num_warps=num_warps,
            )


def adamw_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                masters: Sequence[torch.Tensor | None], steps: Sequence[int], *, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float,
                skip: torch.Tensor | None = None) -> int:
    """The eager launcher: same contract as :func:`adamw_ref`, one launch per pair of param
    dtype and grad dtype (a table row per tensor, see ``_multi``), bit for bit what
    :func:`adamw_scalars_launch` gives. Returns the number of launches. ``skip``: an int32
    [1] flag on the params' device, read by the kernel (no host sync)."""
    from .selective_adamw import adamw_scalars

    _launch.require_triton(triton)
    n_t = len(params)
    if not (len(grads) == len(ms) == len(vs) == len(masters) == len(steps) == n_t):
        raise ValueError("adamw: params, grads, ms, vs, masters and steps must have one length")
    groups: dict[tuple, list[int]] = {}
    for i in range(n_t):
        p, g, master = params[i], grads[i], masters[i]
        _check("params", i, p, p, fp32=False)
        for name, t in (("ms", ms[i]), ("vs", vs[i])) + ((("masters", master),)
                                                         if master is not None else ()):
            _check(name, i, t, p, fp32=True)
        if g.numel() != p.numel() or g.device != p.device:
            raise ValueError(f"grads[{i}] has {g.numel()} elements on {g.device}, params[{i}] "
                             f"{p.numel()} on {p.device}")
        if (master is not None) != (p.dtype != torch.float32):
            raise ValueError(f"params[{i}] is {p.dtype}: it needs "
                             f"{'an fp32 master' if p.dtype != torch.float32 else 'no master'}")
        if p.numel():
            groups.setdefault((p.device, p.dtype, g.dtype), []).append(i)
    launches = 0
    for (device, p_dtype, _), members in groups.items():
        block, num_warps = _launch.block_1d(max(params[i].numel() for i in members))
        meta, hyper, tiles, keep = [], [], [], []
        s0 = None
        aligned = True
        for i in members:
            g = grads[i] if grads[i].is_contiguous() else grads[i].contiguous()
            keep.append(g)  # a contiguous copy must outlive the launch: its address is in the table
            aligned = aligned and _launch.vector_aligned(
                params[i].numel(), params[i], g, ms[i], vs[i], masters[i])
            s = adamw_scalars(lr, beta1, beta2, eps, weight_decay, steps[i])
            s0 = s0 or s
            meta.append([params[i].data_ptr(), g.data_ptr(), ms[i].data_ptr(),
                         vs[i].data_ptr(), masters[i].data_ptr() if masters[i] is not None
                         else 0, params[i].numel()])
            hyper.extend((s["neg_step_size"], s["bc2_sqrt"]))
            tiles.append(_launch.cdiv(params[i].numel(), block))
        total, tabs = _multi.tables(meta, tiles, device, hyper)
        first = members[0]
        with _launch.launching(_adamw_multi_kernel, params[first]):
            _adamw_multi_kernel[(total,)](
                *tabs, len(members), params[first], grads[first],
                _launch.skip_flag(skip, device), s0["decay"], s0["lerp_w"], s0["beta2"], s0["one_minus_beta2"], s0["eps"],
                W=6, SEARCH=_multi.search_steps(len(members)),
                HAS_MASTER=p_dtype != torch.float32, SOFT_BF16=_launch.interpreting(),
                BLOCK=block, ALIGNED=aligned, num_warps=num_warps,
            )
        launches += 1
    return launches


def adamw_ref(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
              masters: Sequence[torch.Tensor | None], steps: Sequence[int], *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              skip: torch.Tensor | None = None) -> None:
    """AdamW per tensor; nothing when ``skip`` (an int32 [1] flag) is nonzero (this reference
    reads it on the host)."""
    if skip is not None and bool(skip):
        return
    for p, g, m, v, master, step in zip(params, grads, ms, vs, masters, steps):
        w = master if master is not None else p
        adamw_(w, g.float() if g.dtype != torch.float32 else g, m, v, lr=lr, beta1=beta1,
               beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        if master is not None:
            p.copy_(master)
