"""The apply: the results of the host job in flight (and any loaded as pending) written into
the host-owned columns of their params, at the step the schedule says (``schedule``).

This is the one place that decides how a window's result lands: wait for the job, agree
with the other ranks that every job succeeded, pick each result's source (an outbox on the
param's device, the master itself, or a one-off copy), gather the ranks' rows, scatter.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..columns.layout import view2d

AGREE = "the host work"


def anything_pending(pipeline, state: dict) -> bool:
    """Whether host work is in flight or a host result waits to be applied (the same on
    every rank: both follow the step count)."""
    return pipeline.inflight or any(isinstance(st, dict) and st.get("host_pending")
                                    for st in state.values())


def apply_pending(items: Iterable[tuple[torch.Tensor, dict]], pipeline, *, link, shard, ops,
                  host_idx: Callable[[torch.Tensor, dict], torch.Tensor],
                  failure: BaseException | None = None) -> None:
    """Wait for the host job in flight, then write every pending result (``st["host_pending"]``
    of the ``(param, state)`` pairs of ``items``) into its param. ``failure``: an earlier
    failure of this rank's host work still to be reported. Under data parallelism every rank
    calls this at the same step: the gather of the results' rows also agrees on the failure
    (every rank raises before anything is written); with nothing to gather the ranks agree
    alone. ``host_idx(p, st)``: the host-owned columns on the param's device."""
    try:
        pipeline.wait()
    except KeyboardInterrupt:  # outside a step (synchronize, eval): nothing changed yet
        raise
    except BaseException as e:  # every rank must hear of it before the gather
        failure = failure or e
    # Every rank has the same pending params (flags set when the job was launched), so
    # every rank makes the same collective.
    pending = [(p, st) for p, st in items if st.get("host_pending")]
    gathered = shard.sharded and bool(pending)  # one process or FSDP2: the vote alone
    if not gathered:
        shard.agree(failure, AGREE)  # raises on every rank if any failed
    boxed: dict = {}
    if failure is None:
        stored, boxed_keys = pipeline.take_results()
        written = {id(key) for key in stored}  # the job wrote these params itself
        for p, st in pending:
            if id(p) in written:
                st["host_pending"] = False
        pending = [(p, st) for p, st in pending if st["host_pending"]]
        # already in each param's dtype: one non-blocking copy per arena (the next job
        # waits for it before it rewrites an outbox: CopyQueue.wait_launched)
        boxed = pipeline.results_on_device([p for p, _ in pending if p in boxed_keys])
    if pending:
        _write(pending, boxed, link=link, shard=shard, ops=ops, host_idx=host_idx,
               failure=failure)


def _write(pending: list[tuple[torch.Tensor, dict]], boxed: dict, *, link, shard, ops,
           host_idx, failure: BaseException | None) -> None:
    """Each pending result into its param's host-owned columns: from its outbox (``boxed``),
    from the master itself where host and param share memory (a CPU fp32 param: nothing
    crosses), else copied once (a result loaded from a checkpoint, which has no outbox yet).
    Under data parallelism every rank's rows are gathered first, in the collective that also
    agrees on ``failure`` (this rank's: it sends zeros of the right shapes, and every rank
    raises before anything is written)."""
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
                             agree=(failure, AGREE))
    for _, st in pending:
        st["host_pending"] = False
    ops.scatter_columns_multi([view2d(p.detach()) for p, _ in pending],
                              [host_idx(p, st) for p, st in pending], srcs)
