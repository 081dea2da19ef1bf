"""The host pipeline: the buffers, jobs and waits of the host half, behind a narrow door.

The optimizer decides *when* (its schedule) and *what* (a :class:`Window` per param at a
window boundary); this room owns *how*: the staging buffers of the window gradients, the
outboxes of the results, the job in flight and its copy-in event, and the host
accumulation jobs. The door:

* :meth:`HostPipeline.accumulate` (``accumulate_on="host"``, every step),
* :meth:`HostPipeline.wait_copy_in` (before the next accumulation into a source on loan),
* :meth:`HostPipeline.launch` (a window boundary), :meth:`HostPipeline.wait` (the job),
* :meth:`HostPipeline.take_results` and :meth:`HostPipeline.results_on_device` (the apply),
* :meth:`HostPipeline.check`, :meth:`HostPipeline.wait_all`, :meth:`HostPipeline.forget`.

Ordering invariants:

* A job owns, until :meth:`wait` returns, the host master and moments of its windows, its
  staging buffers and outboxes, and the params it stores into (a window whose result
  applies at once and whose columns are all host-owned). It borrows the window gradients'
  sources (device accumulators, or a ``.grad``) until its copy-in (``transfer.CopyIn``) is
  done: the next accumulation waits for that (:meth:`wait_copy_in`: on CUDA the training
  stream waits for the copy-in's event, this thread does not; on CPU, where the job's
  thread makes the copies, this thread waits), and :meth:`launch` does the same before
  returning when a source is a ``.grad`` the caller may overwrite.
* The worker runs jobs in submission order: every host accumulation of a window is done
  before that window's job reads its accumulator.
* The apply reads the outboxes with a copy on the link's host-to-device stream that the
  training stream waits for (``Link.to_device_async``); the next job rewrites an outbox
  only after the work queued on the training stream before its own launch is done
  (``CopyQueue.wait_launched``), which includes that wait.
* The staged copy-in is queued at launch on the device-to-host copy stream, after what the
  training thread queued before; the job's other device copies (streamed loads, stores)
  go through a ``transfer.CopyQueue``, on the link's copy streams, ordered the same way.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Hashable, Literal, Sequence

import torch

from ..dist.shard import ShardError
from ..transfer import CopyIn, Link, host_empty
from .adamw import HostAdamW, HostHyper, HostTask, PieceIO
from .outbox import Outboxes
from .step_size import resolve_adaptive
from .worker import HostJob, HostWorker, HostWorkerError

Source = Literal["direct", "device_acc", "host_acc", "host_direct"]


@dataclass
class Window:
    """One param's part of a host job.

    ``source``: where the window's gradient is: ``"direct"`` (a one-step window's own
    gradient columns on the device, ``grad``), ``"device_acc"`` (the fp32 device
    accumulator ``grad``, zeroed by the job once copied) or ``"host_acc"`` (the host
    accumulator ``grad``: the job reads it and zeroes it piece by piece; the next window's
    host accumulation, queued on the same worker after the job, then adds into it again) or
    ``"host_direct"`` (a one-step window's gradient columns already in host memory, in the
    grad's dtype: gradient streaming put them there; complete before any job queued after
    the step's stream jobs runs).
    ``store_into``: the param's flat view, when the job writes the result into it itself.
    ``outbox``: the param, when the result reaches it through an outbox (another dtype, or
    a CUDA param): its dtype, device and the master's shape size the outbox."""
    key: Hashable
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    hyper: HostHyper
    source: Source
    grad: torch.Tensor
    store_into: torch.Tensor | None = None
    outbox: torch.Tensor | None = None
    rows: tuple[int, int] | None = None
    """Data parallelism: the rows ``[r0, r1)`` of a ``"direct"`` source (the whole gradient's
    columns) this rank's host half keeps: it copies only those (an accumulator already holds
    this rank's rows only)."""

    @property
    def dtype(self) -> torch.dtype:
        """The param's dtype (fp32 when the result goes nowhere but the master): a device
        accumulator's window mean is rounded to it once, before it crosses."""
        t = self.outbox if self.outbox is not None else self.store_into
        return t.dtype if t is not None else torch.float32


class HostPipeline:
    @classmethod
    def for_config(cls, link: Link, config) -> "HostPipeline":
        """A pipeline with its own worker thread and AdamW pool, as ``config`` sizes them."""
        threads = config.host_threads or max(1, torch.get_num_threads())
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        if threads > max(8, 4 * cpus):
            raise ValueError(f"host_threads={threads}: this process may use {cpus} CPUs; "
                             "more than 4 threads per CPU only slows the host AdamW down "
                             "(None: one per CPU torch uses)")
        return cls(link, HostAdamW(threads, config.chunk_size, config.host_timeout,
                                   cores=config.host_cores),
                   HostWorker(config.host_timeout), config.host_timeout)

    def __init__(self, link: Link, adamw: HostAdamW, worker: HostWorker,
                 timeout: float) -> None:
        self.link = link
        self.adamw, self.worker = adamw, worker
        self._adamw = adamw
        self._worker = worker
        self._timeout = timeout
        self._inflight: HostJob | None = None
        self._copy_in: tuple[CopyIn, threading.Event] | None = None  # the job's copy-in
        self._adds: list[HostJob] = []  # host accumulation jobs not yet waited for
        # Per-param host buffers for a window gradient that crosses (link buffers), reused
        # across windows.
        self._staging: dict[Hashable, torch.Tensor] = {}
        self._outboxes = Outboxes()
        self._job_outbox: dict[Hashable, torch.Tensor] = {}
        self._stored: list[Hashable] = []
        self.wait_seconds = 0.0
        self.busy_seconds = 0.0
        self.shield: list[BaseException] | None = None
        """While the optimizer is inside the changing part of a step: the waits here hold a
        KeyboardInterrupt back (appended to this list) and go on waiting, so the step
        finishes; the optimizer raises it afterwards."""
        self.multipliers: dict[Hashable, float] = {}
        """The adaptive host lr multiplier of each window of the last adaptive job."""

    # ------------------------------------------------------------------ every step
    def accumulate(self, items: Sequence[tuple[torch.Tensor, torch.Tensor]],
                   label: str) -> None:
        """Add each ``(host accumulator, device columns)``'s columns into the accumulator,
        on the host worker: the columns cross in one copy per device and dtype that does
        not block this thread. The columns must be this step's own copy (a gather), so the
        caller may overwrite the gradient once this returns."""
        groups: dict[tuple, list] = {}
        streamed = [(acc, cols) for acc, cols in items if not isinstance(cols, torch.Tensor)]
        if streamed:  # already on the host (gradient streaming): each adds itself, in order
            def add_streamed(streamed=streamed) -> None:
                for acc, part in streamed:
                    part.add_into(acc)
            self.submit(add_streamed, f"host accumulation of {label}")
        for acc, cols in items:
            if isinstance(cols, torch.Tensor):
                groups.setdefault((cols.device, cols.dtype), []).append((acc, cols))
        for members in groups.values():
            flat = torch.cat([cols.reshape(-1) for _, cols in members])
            host, wait = self.link.to_host_async(flat)
            layout = [(acc, cols.shape, cols.numel()) for acc, cols in members]
            timeout = self._timeout

            def add(host=host, wait=wait, layout=layout) -> None:
                wait(timeout)
                off = 0
                for acc, shape, n in layout:
                    acc.add_(host[off:off + n].view(shape))
                    off += n

            self._adds.append(self._worker.submit(add, f"host accumulation of {label}"))

    def submit(self, fn, label: str) -> None:
        """Run ``fn`` on the host worker, after every job queued before it (a host
        accumulation; gradient streaming's finalize of a step's host columns); its failure
        raises at the next :meth:`check`, and :meth:`wait_all` waits for it."""
        self._adds.append(self._worker.submit(fn, label))

    def check(self) -> None:
        """Raise the error of a failed host accumulation; forget the finished ones."""
        live = []
        for job in self._adds:
            if job.done.is_set():
                self._worker.wait(job)  # returns at once; raises HostWorkerError if it failed
            else:
                live.append(job)
        self._adds = live

    def wait_copy_in(self) -> None:
        """Before the next write to a source on loan to the job in flight (an accumulator):
        on CUDA the training stream waits for the job's copy-in (this thread does not); on
        CPU this thread waits until the job's thread has made it."""
        if self._copy_in is None:
            return
        copy_in, copied_in = self._copy_in
        copy_in.release()  # CUDA sources: the training stream waits, this thread does not
        if copy_in.host_side:  # CPU sources: the job's thread copies them
            t0 = time.perf_counter()
            try:
                self._held(lambda: self._worker.wait_event(
                    copied_in, "the copy-in of the host job in flight"))
            finally:
                self.wait_seconds += time.perf_counter() - t0
        self._copy_in = None

    # ------------------------------------------------------------------ a window
    def launch(self, windows: Sequence[Window], apply_now: bool, label: str) -> None:
        """Hand ``windows`` to the host worker as one job.

        ``apply_now``: the caller waits for this job at once (overlap=False, warm-up). The
        job then streams: each pool worker loads a piece of the gradient straight from its
        source into its own scratch, updates it, and stores it, so no full-size staging
        buffer is needed and each piece is copied while it is in cache. Otherwise the job
        first copies every source into a staging buffer, so the sources are free again early,
        while the host computes. Results for an outbox are cast into it piece by piece, so
        the apply is one plain copy per arena, which does not block the training thread."""
        assert self._inflight is None, "a host job is still in flight"
        if not windows:
            return
        # Outboxes first: a staged window's gradient is staged in its own outbox (the
        # param's dtype), which then carries the result back.
        outboxes = self._outboxes.plan([(w.key, w.master.shape, w.outbox.dtype, w.outbox.device)
                                        for w in windows
                                        if w.store_into is None and w.outbox is not None])
        queue = self.link.copy_queue(_devices(windows), self._timeout)
        stage: list[tuple] = []  # (host dst, src, zero src, divisor or None): see CopyIn
        stored: list[Hashable] = []
        tasks = [self._task(w, apply_now, queue, outboxes, stage, stored) for w in windows]
        copy_in = self.link.copy_in(stage)  # CUDA: queued now on the copy stream
        copied_in = threading.Event()  # the job's thread is past its copy-in
        run = self._job(tasks, [w.key for w in windows], queue, copy_in, copied_in)
        self._inflight = self._worker.submit(run, label)
        self._copy_in = (copy_in, copied_in)
        self._stored = stored
        self._job_outbox = outboxes
        if any(not zero_src for _, _, zero_src, _ in stage):
            # A param's own .grad: the caller may overwrite it once step() returns.
            self.wait_copy_in()

    def _task(self, w: Window, apply_now: bool, queue, outboxes: dict, stage: list,
              stored: list) -> HostTask:
        """``w``'s task of the job: where its gradient comes from (a piece-wise load, a staged
        copy, or the host accumulator itself) and where its result goes."""
        load = store = None
        hyper = w.hyper
        zero_after = None
        if w.source == "host_direct":  # in host memory already, in the grad's dtype
            if w.grad.dtype == torch.float32:
                grad = w.grad.view(w.master.shape)
            else:
                grad, load = None, _staged_load(w.grad.reshape(-1))
        elif w.source == "host_acc":
            # The worker runs jobs in order: this window's adds are done before the job
            # reads the accumulator, and the next window's run after the job zeroed it.
            if w.grad.dtype == torch.float32:
                grad = w.grad
            else:  # a bf16 accumulator: widened piece by piece by the pool
                grad, load = None, _staged_load(w.grad.view(-1))
            zero_after = w.grad.view(-1)
        else:
            zero_src = w.source == "device_acc"  # (holds this rank's rows only)
            src = w.grad if w.rows is None else w.grad[w.rows[0]:w.rows[1]]
            # A window sum is divided before it crosses; rounded when the param is not
            # fp32 (so the host's gradient is the mean in the param's dtype).
            divisor = hyper.grad_divisor if zero_src else None
            if apply_now:  # streamed: never races the job
                self.link.count_d2h(src.numel() * src.element_size())
                rounds = divisor is not None and w.dtype != torch.float32
                grad, load = None, _piece_load(queue, src.reshape(-1), zero_src,
                                               divisor if rounds else None, w.dtype)
                if rounds:
                    hyper = replace(hyper, grad_divisor=1.0)
            else:  # staged in the param's dtype: its outbox, or a buffer of its own
                staged = outboxes.get(w.key)
                if staged is None:
                    staged = self._reusable(w.key, src.shape, w.dtype)
                stage.append((staged, src, zero_src, divisor))
                hyper = replace(hyper, grad_divisor=1.0)
                if staged.dtype == torch.float32:
                    grad = staged.view(w.master.shape)
                else:
                    grad, load = None, _staged_load(staged.view(-1))
        if w.store_into is not None:
            self.link.count_h2d(w.store_into.numel() * w.store_into.element_size())
            store = _piece_store(queue, w.store_into, w.master.view(-1))
            stored.append(w.key)
        elif w.outbox is not None:
            store = _outbox_store(queue, outboxes[w.key].view(-1), w.master.view(-1))
        if zero_after is not None:
            store = _zeroing(store, zero_after)
        io = PieceIO(load, store) if load or store else None
        return HostTask(w.master, grad, w.m, w.v, hyper, io)

    def _job(self, tasks: list[HostTask], keys: list[Hashable], queue, copy_in,
             copied_in: threading.Event):
        """The job's body, run on the host worker: the copy-in, the adaptive step sizes, one
        pool dispatch of every task, the queued copies flushed (also when it fails)."""
        adamw, timeout, pipeline = self._adamw, self._timeout, self

        def run() -> None:
            try:
                copy_in.wait_on_host(timeout)  # CPU: the copies themselves; CUDA: their event
            finally:
                copied_in.set()
            try:
                # The moments are this job's now (the last job was waited for): the adaptive
                # step sizes read them before the update changes them.
                resolved, multipliers = resolve_adaptive(tasks, keys)
                if multipliers:
                    pipeline.multipliers = multipliers  # one assignment: readers see all
                adamw.update_many(resolved)  # every param of the window in one pool dispatch
                queue.flush()  # streamed jobs: the pieces' zeroing and stores are done
            except BaseException:
                try:  # a failed job still finishes what it queued
                    queue.flush()
                except Exception:
                    pass
                raise
        return run

    def _reusable(self, key: Hashable, shape, dtype: torch.dtype) -> torch.Tensor:
        """The staging buffer of ``key`` (a link buffer: pinned where CUDA exists), reused
        across windows; reallocated only when a reselection changed its column count (or
        its dtype)."""
        buf = self._staging.get(key)
        if buf is None or buf.shape != torch.Size(shape) or buf.dtype != dtype:
            buf = self._staging[key] = host_empty(shape, dtype)
        return buf

    def _held(self, wait):
        while True:
            try:
                return wait()
            except KeyboardInterrupt as e:
                if self.shield is None:
                    raise
                self.shield.append(e)

    def wait(self) -> None:
        """Wait for the job in flight (bounded); its error raises here."""
        job = self._inflight
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            self._held(lambda: self._worker.wait(job))
        finally:
            self.wait_seconds += time.perf_counter() - t0
            if job.done.is_set():
                self.busy_seconds += job.busy_seconds
                self._inflight = None
                self._copy_in = None

    def take_results(self) -> tuple[list[Hashable], set[Hashable]]:
        """After :meth:`wait`: the keys whose params the job wrote itself, and the keys whose
        results wait in an outbox (for :meth:`results_on_device`)."""
        stored, self._stored = self._stored, []
        boxed, self._job_outbox = set(self._job_outbox), {}
        return stored, boxed

    def results_on_device(self, keys: Sequence[Hashable]) -> dict[Hashable, torch.Tensor]:
        """The outboxes of ``keys`` on their devices: one copy per arena on the copy stream,
        which the training stream waits for (the training thread does not)."""
        return self._outboxes.to_device(self.link, list(keys)) if keys else {}

    # ------------------------------------------------------------------ around checkpoints
    @property
    def inflight(self) -> bool:
        return self._inflight is not None

    def wait_all(self) -> None:
        """Wait for the job in flight and every host accumulation."""
        self.wait()
        adds, self._adds = self._adds, []
        for job in adds:
            self._worker.wait(job)

    def forget(self) -> None:
        """The state the jobs work for is being replaced (load_state_dict): wait for them,
        failed or not, and drop what they left for their apply."""
        try:
            self.wait_all()
        except (HostWorkerError, ShardError):  # a failed job, another rank's failure
            pass
        self._stored, self._job_outbox, self._copy_in = [], {}, None
        self._outboxes.clear_plan()

    def abandon(self) -> None:
        """close(): the worker finishes queued jobs before it stops; forget them here."""
        self._inflight = None
        self._adds = []

    def staging_bytes(self) -> int:
        return (sum(b.numel() * b.element_size() for b in self._staging.values())
                + self._outboxes.nbytes() + self._adamw.scratch_bytes())

    def host_buffers(self) -> list[tuple[torch.Tensor, bool]]:
        """Every host tensor this room holds besides the state: ``(tensor, crosses the
        link)``: the staging buffers the copy-in writes and the outbox arenas, all link
        buffers. The workers' scratch is :meth:`scratch_bytes`."""
        out = [(b, True) for b in self._staging.values()]
        return out + [(a, True) for a in self._outboxes.arenas()]

    def scratch_bytes(self) -> tuple[int, int]:
        """The pool workers' scratch: ``(link buffers, pageable)``: the pieces a streamed job
        copies into them, and the fp32 copies of low-precision moment pieces."""
        return self._adamw.scratch_bytes(), self._adamw.moment_scratch_bytes()



def _devices(windows: Sequence[Window]) -> set[torch.device]:
    """The devices a job's copies touch: its gradients' sources, the params it stores into,
    and its outboxes (the queue must know an outbox's device even when no gradient crosses,
    as under host accumulation: ``wait_launched()`` waits for that device's apply)."""
    devices = set()
    for w in windows:
        if w.store_into is None and w.outbox is not None:
            devices.add(w.outbox.device)
        if w.source not in ("host_acc", "host_direct"):
            devices.add(w.grad.device)
        if w.store_into is not None:
            devices.add(w.store_into.device)
    return devices


# A task's piece-wise loads and stores (``PieceIO``), run on the pool's workers; ``queue``
# is the job's ``transfer.CopyQueue``.
def _piece_load(queue, flat: torch.Tensor, zero: bool, divisor: float | None,
                dtype: torch.dtype):
    def load(s: int, e: int, out: torch.Tensor) -> None:
        queue.copy(out, flat[s:e])
        if zero:
            queue.zero_(flat[s:e])
        if divisor is not None:  # the mean rounded to the param's dtype, as staged
            out.div_(divisor)
            out.copy_(out.to(dtype))
    return load


def _staged_load(staged: torch.Tensor):  # the host casts, piece by piece, in cache
    def load(s: int, e: int, out: torch.Tensor) -> None:
        out.copy_(staged[s:e])
    return load


def _piece_store(queue, param_flat: torch.Tensor, master_flat: torch.Tensor):
    def store(s: int, e: int) -> None:
        queue.copy(param_flat[s:e], master_flat[s:e])
    return store


def _zeroing(inner, flat: torch.Tensor):  # store, then zero the piece of the source
    def store(s: int, e: int) -> None:
        if inner is not None:
            inner(s, e)
        flat[s:e].zero_()
    return store


def _outbox_store(queue, box: torch.Tensor, master_flat: torch.Tensor):
    def store(s: int, e: int) -> None:
        queue.wait_launched()  # the last apply's non-blocking copy may still read it
        queue.copy(box[s:e], master_flat[s:e])
    return store
