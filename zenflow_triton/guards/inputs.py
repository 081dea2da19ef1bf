"""The optimizer's inputs, checked before anything changes: the params at construction
(real floating point, DTensors only as FSDP2 shards them, a layout a column split can view) and the gradients of
each step (dense, real, of the param's shape, and optionally finite)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from ..dist.fsdp import check_param, is_dtensor, local
from ..config import DEFAULT_DENSE_PARAMS, ZenFlowConfig, matches_any
from ..state import MATRIX
from ..columns.layout import splittable


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf; raised by step() before any state changes (or, with
    ``check_finite_at="boundary"``, at the next boundary, the masked steps undone)."""


Work = list[tuple[dict, torch.Tensor, torch.Tensor]]
"""(group, param, grad) of every param that has a gradient this step, in group order."""


def check_params(param_groups: list[dict], kind_of: Callable[[torch.Tensor], str],
                 name_of: Callable[[torch.Tensor], str]) -> None:
    """TypeError / ValueError naming the first param this optimizer cannot take
    (``kind_of``: MATRIX or SMALL, as the optimizer classifies it); a param listed twice
    (torch only warns: its state would be updated twice a step)."""
    seen: set[int] = set()
    for group in param_groups:
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"{name_of(p)} is listed twice in the params; each param "
                                 "may appear once (model.named_parameters() lists each once)")
            seen.add(id(p))
            if p.is_complex():
                raise TypeError(f"{name_of(p)} is complex; ZenFlowOptimizer supports real "
                                "floating-point params only")
            if not p.is_floating_point():
                raise TypeError(f"{name_of(p)} has dtype {p.dtype}; only floating-point "
                                "params can be optimized")
            if is_dtensor(p):
                check_param(p, name_of(p))
            if kind_of(p) == MATRIX and not splittable(local(p)):
                raise ValueError(
                    f"{name_of(p)} has strides {p.stride()}, in which its rows (dim 0) are "
                    "not the outermost dim of a dense layout; column-split params need one "
                    "(contiguous, channels_last, or any 2-D layout); raise min_offload_numel "
                    "to keep it whole on the device")


def collect(param_groups: list[dict], name_of: Callable[[torch.Tensor], str]) -> Work:
    """Every trainable param with a gradient; TypeError / ValueError naming the param for a
    sparse or complex gradient or one of another shape."""
    work = []
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None or not p.requires_grad:
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise TypeError(f"{name_of(p)} has a sparse gradient; "
                                "ZenFlowOptimizer supports dense gradients only")
            if g.is_complex():
                raise TypeError(f"{name_of(p)} has a complex gradient; "
                                "ZenFlowOptimizer supports real gradients only")
            if g.shape != p.shape:
                raise ValueError(f"{name_of(p)}: gradient shape {tuple(g.shape)} does not "
                                 "match the param")
            work.append((group, p, g))
    return work


def check_names(param_groups: list[dict], config: ZenFlowConfig) -> None:
    """Warn where the dense set cannot do what it says: params given without names (then
    ``dense_params`` matches nothing, and embeddings and the LM head are split like any
    matrix), or a pattern of the user's that matches no param's name."""
    if not config.dense_params:
        return
    names = [n for g in param_groups for n in (g.get("param_names") or ())]
    if not names:
        if any(p.dim() >= 2 for g in param_groups for p in g["params"]):
            trainer = _built_by_hf_trainer()
            warnings.warn(
                "ZenFlowOptimizer got its params without names, so dense_params "
                f"{config.dense_params} matches nothing: embeddings and the LM head are split "
                "like any matrix. Pass model.named_parameters() or groups of (name, param) "
                "pairs (for the HF Trainer: zenflow_triton.hf.trainer_kwargs(model)); "
                "dense_params=() says no dense set is meant"
                + (". Built by the HF Trainer (optimizer_cls_and_kwargs), nothing finishes "
                   "training: trainer.save_model() after train() would miss the last window's "
                   "host-owned columns. Use **zenflow_triton.hf.trainer_kwargs(model, args) "
                   "instead, or add callbacks=[zenflow_triton.hf.ZenFlowCallback()] to the "
                   "Trainer" if trainer else ""), UserWarning, stacklevel=3)
        return
    if tuple(config.dense_params) != DEFAULT_DENSE_PARAMS:
        unmatched = [pat for pat in config.dense_params
                     if not any(matches_any(n, (pat,)) for n in names)]
        if unmatched:
            warnings.warn(f"dense_params: {unmatched} match no param name (names are like "
                          f"{names[0]!r})", UserWarning, stacklevel=3)


def _built_by_hf_trainer(depth: int = 12) -> bool:
    """Whether the optimizer is being built inside ``transformers.Trainer.create_optimizer``
    (its ``optimizer_cls_and_kwargs`` route), by the calling frames."""
    import sys

    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "create_optimizer" and "transformers" in code.co_filename:
            return True
        frame = frame.f_back
    return False
