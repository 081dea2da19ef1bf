"""The apply: a finished host job's results written into the host-owned columns of their
params, at the step the schedule says."""

from __future__ import annotations

import torch

from ..columns.layout import view2d


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
