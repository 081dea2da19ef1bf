"""The windows that end at a host boundary: each matrix param's closed into a
:class:`host.Window` (what crosses, the hyperparameters of the launching step with the host
step size, where the result goes); the result is applied later (``host.apply``)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import NamedTuple

import torch

from ..config import ZenFlowConfig
from .adamw import HostHyper
from .pipeline import Window
from .step_size import SUMS, sample_sums, window_lr
from ..columns.layout import view2d
from ..dist.fsdp import is_dtensor, local
from ..state import MATRIX


HYPER = ("lr", "betas", "eps", "weight_decay")


def step_hyper(param_groups: list[dict]) -> list[dict]:
    """Each group's hyperparameters as a step runs with them (a window launched later, by
    ``finish()``, takes its last step's: :func:`launched_at`)."""
    return [{k: g[k] for k in HYPER} for g in param_groups]


@contextlib.contextmanager
def launched_at(param_groups: list[dict], hyper: list[dict] | None):
    """The groups at ``hyper`` (:func:`step_hyper` of the window's last step) while a window
    launches outside a step, then as they were. A window takes the betas, eps and weight
    decay of the step that closes it (its lr: the mean of its steps', :func:`window_base_lr`);
    ``finish()`` closes the open window after that step, when a scheduler has already written
    the next step's."""
    if hyper is None or len(hyper) != len(param_groups):
        yield
        return
    now = step_hyper(param_groups)
    try:
        for g, h in zip(param_groups, hyper):
            g.update(h)
        yield
    finally:
        for g, h in zip(param_groups, now):
            g.update(h)


class OnHost(NamedTuple):
    """A one-step window's gradient columns already in host memory (gradient streaming),
    where ``direct`` otherwise holds them on the device."""
    grad: torch.Tensor


def close_windows(param_groups: list[dict], state, config: ZenFlowConfig, shard, direct: dict,
                  apply_now: bool, warmup: bool) -> list[Window]:
    """The window of every matrix param that accumulated a gradient since its last one, in
    param order, with the adaptive step sizes' statistics shared over the ranks. ``state``:
    the optimizer's (keyed by param; ``dist.fsdp.local`` gives a DTensor's own rows)."""
    windows = [close_window(group, local(p), st, config, shard, direct, apply_now, warmup,
                            p.shape[0] if is_dtensor(p) else None)
               for group in param_groups for p in group["params"]
               for st in (state.get(p),)
               if isinstance(st, dict) and st.get("kind") == MATRIX and st["acc_count"]]
    return share_adaptive_sums(windows, shard)


def close_window(group: dict, p: torch.Tensor, st: dict, config: ZenFlowConfig, shard,
                 direct: dict, apply_now: bool, warmup: bool,
                 whole_rows: int | None = None) -> Window:
    """The host's part of ``p``'s window that ends now (``st["acc_count"]`` > 0
    gradients): its source (``direct``: the one-step window's columns, else the window
    sum), AdamW at this step's hyperparameters with the host lr multiplier, and where the
    result goes (the param itself, when the job applies it at once and owns every column;
    else an outbox for a CUDA or low-precision param; else the master). Counts the host
    step and marks the result pending. ``whole_rows``: the rows of the whole param when
    ``p`` is this rank's rows of it (FSDP2), else None."""
    count = st["acc_count"]
    if isinstance(direct.get(p), OnHost):  # streamed during backward, in the grad's dtype
        source, grad = "host_direct", direct[p].grad
    elif p in direct:  # in the grad's dtype over the link, fp32 on the host
        source, grad = "direct", direct[p]
    elif config.accumulate_on == "device":  # the window sum, once a window
        source, grad = "device_acc", st["acc"]
    else:
        source, grad = "host_acc", st["acc"]
    p2d = view2d(p.detach())
    full_host = st["host_idx"].numel() == p2d.shape[1]
    sharded = shard.sharded  # then every rank's rows meet at the apply
    store_into = (p2d.view(-1) if apply_now and full_host and not sharded
                  and p2d.is_contiguous() else None)
    needs_box = store_into is None and (p.device.type == "cuda" or p.dtype != torch.float32)
    base_lr = window_base_lr(st, group["lr"], count)
    st["acc_count"] = 0
    st["host_pending"] = True
    beta1, beta2, st["host_step"], step = window_betas(config.host_betas, *group["betas"],
                                                       st["host_step"], count)
    lr, adaptive_window = window_lr(config.host_lr_scale, base_lr, count, warmup)
    hyper = HostHyper(lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"], step=step,
                      grad_divisor=float(count), adaptive_window=adaptive_window)
    if shard.collective and hyper.adaptive_window:  # this rank's part; share_adaptive_sums
        whole = p2d.shape[0] if whole_rows is None else whole_rows  # adds them up
        r0, _ = shard.chunk_rows(whole)
        width = st["host_master"].shape[1]
        hyper = replace(hyper, adaptive_sums=tuple(sample_sums(
            st["host_master"], st["host_m"], st["host_v"], r0 * width, whole * width)))
    rows = (shard.rows(p2d.shape[0])  # the accumulators hold only this rank's rows
            if sharded and source == "direct" else None)
    return Window(p, st["host_master"], st["host_m"], st["host_v"], hyper, source, grad,
                  store_into, p.detach() if needs_box else None, rows)


def window_base_lr(st: dict, lr: float, count: int) -> float:
    """The base learning rate of a window of ``count`` gradients that closes at a step of
    ``lr``: the mean of its steps' own lrs (``st["acc_lr"]`` sums them), so a window under a
    schedule moves its columns by what AdamW's steps would have summed to (a window that
    closes in the lr warm-up does not take the larger lr of its last step, and one that
    ``finish()`` closes after a decay to zero still applies its gradients). Resets the sum.
    A state saved before the sum existed, mid-window, takes ``lr`` for that window."""
    total = st.get("acc_lr")
    st["acc_lr"] = 0.0
    return lr if total is None else total / count


def window_betas(mode: str, beta1: float, beta2: float, host_step: int,
                 n: int) -> tuple[float, float, int, int | float]:
    """``(beta1, beta2, host_step, step)`` of the host AdamW step on a window of ``n``
    gradients: its betas, the param's new ``host_step`` and the step the update's bias
    corrections take (``1 - beta ** step``), under ``ZenFlowConfig.host_betas``.

    ``host_step`` is always the exponent of the group's betas in the host moments' bias
    corrections (what a migration rescales by: ``columns.migration.moment_scales``): under
    "step" the windows so far (each decays the moments once by the betas), under "window"
    the gradients so far (each window decays them by ``beta ** n``). So under "window" the
    step is ``host_step / n`` in units of the window's betas: an int when every window held
    ``n`` gradients, a fraction otherwise, exact either way."""
    if mode == "step":
        return beta1, beta2, host_step + 1, host_step + 1
    grads = host_step + n
    step = grads / n
    return beta1 ** n, beta2 ** n, grads, int(step) if step.is_integer() else step


def share_adaptive_sums(windows: list[Window], shard) -> list[Window]:
    """Under data parallelism or FSDP2: the adaptive step size of each window from every
    rank's rows of its host half, as one process would take it. Each rank's ``close_window`` sampled its
    own rows (at the positions the whole host half would sample); one all-reduce adds them,
    so every rank resolves the same multiplier. The moments are final here: no host job is
    in flight when a window launches."""
    mine = [i for i, w in enumerate(windows) if w.hyper.adaptive_sums is not None]
    if not mine or not shard.collective:
        return windows
    parts = torch.tensor([windows[i].hyper.adaptive_sums for i in mine], dtype=torch.float64)
    assert parts.shape[1] == SUMS
    total = shard.all_reduce_sum(parts, "an all-reduce of the adaptive step sizes' statistics")
    out = list(windows)
    for i, sums in zip(mine, total):
        out[i] = replace(out[i], hyper=replace(out[i].hyper, adaptive_sums=tuple(sums)))
    return out
