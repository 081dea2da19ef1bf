"""Data parallelism: which rows of each host half this rank owns, and the collectives.

Under data parallelism (DDP: every rank holds the same params and, after the all-reduce, the
same gradients) every rank makes the same selection and the same device updates; the host
half is sharded **by rows**: of a matrix param's host-owned part ``[rows, n]``, rank ``r``
keeps the fp32 master and moments of rows ``[r * c, (r + 1) * c)``, ``c = ceil(rows /
world)`` (clipped), runs the host AdamW on them, and at the apply point every rank's rows are
gathered into every rank's param. Rows, not columns: a selection moves whole columns, so a
rank's rows of any column are its own whatever the selection, and migration needs no
re-sharding: a column leaving the device is sliced locally, one entering it is gathered.

Under FSDP2 the params themselves are split by rows (``fsdp``): ``split_rows=False``, each
rank's tensors are its rows, nothing is gathered, and the ranks only reduce what must be
seen whole (column scores, the adaptive step size's statistics) and vote.

The engine is ``torch.distributed``; collectives run on the params' device (NCCL tensors on
GPUs, CPU tensors with gloo). A single process is a world of one: no collective is made.
"""

from __future__ import annotations

import collections
import datetime
from typing import Sequence

import torch


class ShardError(RuntimeError):
    """Another rank failed (its host worker raised, or it timed out)."""


class RowShard:
    """This rank's rows of every host half, and the collectives that join them."""

    def __init__(self, group=None, timeout: float = 600.0, split_rows: bool = True) -> None:
        """``group``: a ``torch.distributed`` process group, or None: the default group when
        torch.distributed is initialized with more than one rank, else a world of one.
        ``split_rows=False``: FSDP2 split the params by rows already (``fsdp``): each rank's
        tensors are its rows, whole to this class (:meth:`rows` is all of them, nothing is
        gathered), and the ranks only reduce what must be seen whole (:meth:`sum_rows`,
        :meth:`all_reduce_sum`) and vote (:meth:`agree`)."""
        import torch.distributed as dist

        self.group = group
        self.timeout = float(timeout)
        self.split_rows = split_rows
        self.bytes = 0
        """Bytes this rank has handed to the collectives it made (each one's input)."""
        self._recent: collections.deque = collections.deque(maxlen=KEEP_WORKS)
        """The last collectives' work objects, held from Python (see :meth:`_wait`)."""
        self._riding: torch.Tensor | None = None  # values for the next vote (:meth:`ride`)
        self._ridden: torch.Tensor | None = None  # their sums, once a vote brought them
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.rank, self.world = 0, 1
            self.device = torch.device("cpu")
        else:
            self.rank = dist.get_rank(group)
            self.world = dist.get_world_size(group)
            # Where this group's collectives run: NCCL needs CUDA tensors, gloo takes CPU ones.
            self.device = (torch.device("cuda", torch.cuda.current_device())
                           if dist.get_backend(group) == "nccl" else torch.device("cpu"))

    @classmethod
    def for_params(cls, params: list[torch.Tensor], process_group, timeout: float) -> "RowShard":
        """The shard of an optimizer over ``params``: FSDP2 DTensors (``dist.fsdp``) reduce and
        vote over their mesh's group, their rows split already; other params split the host
        halves by rows over ``process_group`` (None: the default group, if any)."""
        from .fsdp import mesh_group

        mesh = mesh_group(params)
        if mesh is not None and process_group is not None and process_group is not mesh:
            raise ValueError("process_group: FSDP2 params reduce over their mesh's group; "
                             "leave process_group=None")
        return cls(process_group if mesh is None else mesh, timeout=timeout,
                   split_rows=mesh is None)

    @property
    def gone(self) -> bool:
        """Whether the ranks can no longer meet: torch.distributed was torn down
        (``destroy_process_group()``) under a collective shard."""
        import torch.distributed as dist
        return self.collective and not (dist.is_available() and dist.is_initialized())

    @property
    def collective(self) -> bool:
        """More than one rank: votes and reductions are collectives."""
        return self.world > 1

    @property
    def sharded(self) -> bool:
        """This class splits the host halves by rows (data parallelism over whole params):
        a rank keeps :meth:`rows` of each, and the ranks gather each other's."""
        return self.world > 1 and self.split_rows

    def rows(self, total: int) -> tuple[int, int]:
        """This rank's rows ``[r0, r1)`` of a host half with ``total`` rows (may be empty);
        all of them when the rows were split before (``split_rows=False``)."""
        if not self.split_rows:
            return 0, total
        return self.chunk_rows(total)

    def chunk_rows(self, total: int) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of this rank's chunk of ``total`` (``torch.chunk``'s split, which
        is DTensor's ``Shard(0)`` and so FSDP2's)."""
        chunk = -(-total // self.world)
        r0 = min(total, self.rank * chunk)
        return r0, min(total, r0 + chunk)

    def chunk(self, total: int) -> int:
        return -(-total // self.world)

    # ------------------------------------------------------------------ collectives
    def gather_rows(self, parts: Sequence[torch.Tensor], totals: Sequence[int],
                    agree: tuple[BaseException | None, str] | None = None,
                    what: str = "an all-gather of the host halves' rows"
                    ) -> list[torch.Tensor]:
        """Every rank gives its rows ``parts[i]`` (``[r1 - r0, n_i]``); each gets back the
        full ``[totals[i], n_i]``, in order: one all-gather per (device, dtype) of the parts,
        in the order they first appear (the same on every rank, which gives the same parts),
        each rank's rows padded to ``chunk``.

        ``agree=(failure, what)``: the gather is also :meth:`agree`'s vote (a flag per rank
        rides in each all-gather), so an apply point waits on one collective, not two; a
        rank whose ``failure`` is set gives parts of the right shapes (their values are not
        used) and raises it, the others a :class:`ShardError`, before anything is returned."""
        if not self.sharded:  # (FSDP2 votes before: the optimizer's drain)
            if agree is not None and agree[0] is not None:
                raise agree[0]
            return list(parts)
        kinds: dict[tuple, list[int]] = {}
        for i, part in enumerate(parts):
            kinds.setdefault((part.device, part.dtype), []).append(i)
        out: list[torch.Tensor] = [None] * len(parts)  # type: ignore[list-item]
        failed: set[int] = set()
        for members in kinds.values():
            full, flags = self._gather_kind([parts[i] for i in members],
                                            [totals[i] for i in members],
                                            None if agree is None else agree[0] is not None,
                                            what)
            failed.update(r for r, f in enumerate(flags) if f)
            for i, t in zip(members, full):
                out[i] = t
        if agree is not None:
            if agree[0] is not None:
                raise agree[0]
            _raise_failed(sorted(failed), agree[1])
        return out

    def _gather_kind(self, parts: Sequence[torch.Tensor], totals: Sequence[int],
                     flag: bool | None, what: str) -> tuple[list[torch.Tensor], list[bool]]:
        """:meth:`gather_rows` of parts of one device and dtype: one all-gather; with
        ``flag``, each rank's flag rides after its rows (0 or 1, exact in any float dtype),
        and every rank's comes back."""
        import torch.distributed as dist

        dtype, device = parts[0].dtype, parts[0].device
        widths = [p.shape[1] for p in parts]
        sizes = [self.chunk(t) * w for t, w in zip(totals, widths)]
        extra = 0 if flag is None else 1
        mine = torch.zeros(sum(sizes) + extra, dtype=dtype, device=device)
        if flag:
            mine[-1] = 1
        off = 0
        for part, size in zip(parts, sizes):
            mine[off:off + part.numel()].copy_(part.reshape(-1))
            off += size
        every = torch.empty(self.world * mine.numel(), dtype=dtype, device=device)
        self.bytes += mine.numel() * mine.element_size()
        # all_gather_single is all_gather_into_tensor's newer name (torch >= 2.13).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._wait(gather(every, mine, group=self.group, async_op=True), what)
        every = every.view(self.world, -1)
        flags = [bool(f) for f in every[:, -1].tolist()] if extra else []
        out = []
        off = 0
        for total, width, size in zip(totals, widths, sizes):
            chunk = self.chunk(total)
            out.append(every[:, off:off + size].reshape(self.world * chunk, width)[:total])
            off += size
        return out, flags

    def all_reduce_sum(self, t: torch.Tensor, what: str) -> list:
        """The sum over ranks of ``t`` (a small host tensor), read back as ``tolist()`` (one
        host read): every rank gets the same values. One all-reduce, bounded by
        ``timeout``."""
        if not self.collective:
            return t.tolist()
        import torch.distributed as dist

        buf = t.to(self.device, copy=True)
        self.bytes += buf.numel() * buf.element_size()
        self._wait(dist.all_reduce(buf, group=self.group, async_op=True), what)
        return buf.tolist()

    def any_rank(self, flags: list[bool], what: str) -> list[bool]:
        """Per flag, whether any rank set it (one all-reduce; a world of one returns
        ``flags``): FSDP2's vote on the gradients' NaN/inf flags, each rank having checked
        only its rows. What :meth:`ride` was given rides in the same all-reduce."""
        riding = self._riding
        if riding is None or self._ridden is not None:
            summed = self.all_reduce_sum(torch.tensor(flags, dtype=torch.int32), what)
            return [bool(n) for n in summed]
        both = torch.cat([torch.tensor(flags, dtype=torch.float64, device=riding.device),
                          riding])  # 0/1 flags add up exactly in float64
        summed = self.all_reduce_sum(both, what)
        self._ridden = torch.tensor(summed[len(flags):], dtype=torch.float64)
        return [bool(n) for n in summed[:len(flags)]]

    def ride(self, values: torch.Tensor) -> None:
        """``values`` (1-D) to be summed over the ranks by the next vote of :meth:`any_rank`,
        so that they cost no collective of their own; :meth:`ridden` gives the sums. Every
        rank gives as many values."""
        self._riding, self._ridden = values.double(), None

    def ridden(self, what: str) -> torch.Tensor:
        """The sums over the ranks of the values :meth:`ride` was given last (float64, on the
        host): those the vote brought, or, where no vote came since (no NaN/inf check), one
        all-reduce of their own."""
        riding, ridden, self._riding, self._ridden = self._riding, self._ridden, None, None
        if riding is None:
            raise RuntimeError("ridden() without ride(): nothing was offered this step")
        if ridden is None:
            ridden = torch.tensor(self.all_reduce_sum(riding, what), dtype=torch.float64)
        return ridden

    def sum_rows(self, partials: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """Per-column sums over every rank's rows, from each rank's sums over its own
        (``partials``, 1-D, on their devices): one all-reduce per device when FSDP2 split the
        rows, else (every rank holds whole params) the partials are the sums already."""
        if self.split_rows or not self.collective or not partials:
            return list(partials)
        import torch.distributed as dist

        out: list[torch.Tensor] = [None] * len(partials)  # type: ignore[list-item]
        kinds: dict[torch.device, list[int]] = {}
        for i, t in enumerate(partials):
            kinds.setdefault(t.device, []).append(i)
        for device, members in kinds.items():
            flat = torch.cat([partials[i].float() for i in members]).to(self.device)
            self.bytes += flat.numel() * flat.element_size()
            self._wait(dist.all_reduce(flat, group=self.group, async_op=True), what)
            flat = flat.to(device)
            off = 0
            for i in members:
                n = partials[i].numel()
                out[i] = flat[off:off + n]
                off += n
        return out

    def agree(self, failure: BaseException | None, what: str) -> None:
        """Every rank says whether ``what`` failed on it; if any did, every rank raises (its
        own error where it failed, a :class:`ShardError` naming the failed ranks elsewhere).
        Bounded by ``timeout``: a rank that never arrives makes the others raise."""
        if not self.collective:
            if failure is not None:
                raise failure
            return
        import torch.distributed as dist

        flags = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        flags[self.rank] = 1 if failure is not None else 0
        self.bytes += flags.numel() * flags.element_size()
        try:
            self._wait(dist.all_reduce(flags, group=self.group, async_op=True), what)
        except ShardError as e:
            raise e from failure
        if failure is not None:
            raise failure
        _raise_failed([r for r, f in enumerate(flags.tolist()) if f], what)

    def _wait(self, work, what: str) -> None:
        """Wait for an async collective, bounded by ``timeout``: a rank that never joins it
        (dead, or stuck) makes this one raise instead of hang.

        The work object is then held from Python for the next :data:`KEEP_WORKS`
        collectives: otherwise the backend's thread may release it last, after it is done
        (gloo's run loop does), and releasing its tensors there takes the GIL; at exit that
        thread then either waits forever for a main thread that joins it while holding the
        GIL (a hang), or is ended by the finalizing interpreter inside a destructor that
        may not throw (``terminate called without an active exception``, SIGABRT). Held
        here, the last release happens on this thread, with the GIL
        (docs/distributed.md, "The end of a run")."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            raise ShardError(f"{what}: the other ranks did not join within {self.timeout} s "
                             f"({type(e).__name__}: {e})") from e
        self._recent.append(work)


KEEP_WORKS = 4
"""How many of its last collectives' work objects a RowShard holds (their tensors with them):
older ones' run-loop iterations have ended long since."""


def _raise_failed(failed: Sequence[int], what: str) -> None:
    """The outcome of a vote on a rank where ``what`` succeeded: a :class:`ShardError` naming
    the ranks where it failed, if any."""
    if failed:
        raise ShardError(f"{what} failed on rank(s) {list(failed)}; this rank cannot go on "
                         "(load the last checkpoint into a new optimizer on every rank)")
