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

from . import _launch
from ..adamw_math import adamw_
from .columns import cast_rtne
from .selective_adamw import _adamw_math

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
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_MASTER:
        w = tl.load(master_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    w, m, v = _adamw_math(w, g, m, v, decay, lerp_w, beta2, one_minus_beta2, eps,
                          neg_step_size, bc2_sqrt)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, cast_rtne(w, p_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


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
        wrap_triton(_adamw_kernel)[(_launch.cdiv(n, block),)](
            p, g, m, v, master if master is not None else m,  # dummy, never touched
            n, decay, lerp_w, beta2, one_minus_beta2, eps, neg_step_sizes[i], bc2_sqrts[i],
            HAS_MASTER=master is not None, SOFT_BF16=soft_bf16, BLOCK=block,
            num_warps=num_warps,
        )


def adamw_ref(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              ms: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
              masters: Sequence[torch.Tensor | None], steps: Sequence[int], *,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    for p, g, m, v, master, step in zip(params, grads, ms, vs, masters, steps):
        w = master if master is not None else p
        adamw_(w, g.float() if g.dtype != torch.float32 else g, m, v, lr=lr, beta1=beta1,
               beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
        if master is not None:
            p.copy_(master)
