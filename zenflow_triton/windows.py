"""A matrix param's window at the host boundary: closed into a :class:`host.Window` (what
crosses, the hyperparameters of the launching step, where the result goes), and its result
applied into the param's host-owned columns."""

from __future__ import annotations

from dataclasses import replace

import torch

from .config import ZenFlowConfig
from .host import HostHyper, Window
from .host.step_size import SUMS, sample_sums
from .partition import view2d


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
    if p in direct:  # in the grad's dtype over the link, fp32 on the host
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
    st["acc_count"] = 0
    st["host_step"] += 1
    st["host_pending"] = True
    beta1, beta2 = group["betas"]
    hyper = HostHyper(lr=group["lr"] * config.host_lr_multiplier(count, warmup), beta1=beta1,
                      beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                      step=st["host_step"], grad_divisor=float(count),
                      adaptive_window=config.adaptive_window(count, warmup))
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


def apply_results(pending: list[tuple[torch.Tensor, dict]], boxed: dict, *, link, shard, ops,
                  host_idx, failure: BaseException | None = None) -> None:
    """Write each pending host result into its param's host-owned columns: from its outbox
    on the param's device (``boxed``), from the master itself where host and param share
    memory (a CPU fp32 param: nothing crosses), else copied once (a result loaded from a
    checkpoint, which has no outbox yet). Under data parallelism every rank's rows are
    gathered first, in the collective that also agrees whether the host work succeeded on
    every rank (``failure``: this rank's; it gives zeros of the right shapes, and every rank
    raises before anything is written). ``host_idx(p, st)``: the host-owned columns on the
    param's device."""
    srcs = []
    for p, st in pending:
        if failure is not None:  # only the shapes count: the gather raises on every rank
            r0, r1 = shard.rows(view2d(p).shape[0])
            srcs.append(torch.zeros(r1 - r0, st["host_idx"].numel(), dtype=p.dtype,
                                    device=p.device))
        elif p in boxed:
            srcs.append(boxed[p])
        elif p.device.type == "cpu" and p.dtype == torch.float32:
            srcs.append(st["host_master"])  # one memory: nothing crosses, nothing waits
            link.count_h2d(st["host_master"].numel() * 4)
        else:  # a result loaded from a checkpoint: no outbox yet (once, blocking)
            srcs.append(link.to_device(st["host_master"], p.device, dtype=p.dtype))
    # This rank's rows of each result -> all rows, on every rank (as is, unsharded).
    srcs = shard.gather_rows(srcs, [view2d(p).shape[0] for p, _ in pending],
                             agree=(failure, "the host work"))
    for _, st in pending:
        st["host_pending"] = False
    ops.scatter_columns_multi([view2d(p.detach()) for p, _ in pending],
                              [host_idx(p, st) for p, st in pending], srcs)
