"""Host AdamW over flat fp32 buffers, in chunks, on a persistent pool of threads.

What runs: ``torch._fused_adamw_`` (torch's vectorised CPU AdamW: one pass that reads
param, grad, m, v and writes param, m, v, 28 bytes per element) on pieces of at most
``chunk_size`` elements, spread over ``threads`` worker threads. torch releases the GIL
inside the kernel, so the workers run in parallel. Each worker limits its own OpenMP team to
one thread (``omp_set_num_threads`` is per thread), so ``threads`` workers use ``threads``
cores and never oversubscribe them; the process-wide ``torch.get_num_threads()`` is left
alone. Where torch has no fused CPU AdamW, the same pieces run ``adamw_math.adamw_``.

Numbers: the fused kernel matches ``torch.optim.AdamW`` (single tensor, ``adamw_math``) to
fp32 rounding (same formula, constants rounded alike; the moments come out bit-identical and
the param within an ulp). It processes a tensor in vectors of 8 (AVX2) or 16 (AVX-512)
elements and its last ``n % 8`` elements in a scalar loop that rounds differently. So that
the result never depends on ``threads`` or ``chunk_size``, every piece starts at a multiple
of ``ALIGN`` = 64 elements of its tensor (256 bytes, a multiple of every vector width): an
element is then in the vector body or the scalar tail the same way whatever the split, and
the runs are bit-identical.

Pipeline: a task may bring its gradient and take its result piece by piece (``PieceIO``).
A worker then copies the gradient piece into its own scratch buffer (reused, at most one
batch of such pieces: ``STREAM_PIECE`` elements, fewer with a small ``chunk_size``), runs the
kernel on it while the piece is still in cache, and copies the master piece out at once. With several workers, one copies while
another computes, so copy-in of one piece, compute on another and copy-out of a third
overlap; no full-size staging buffer is needed.

Ordering: the pieces of one ``update_many`` call touch disjoint slices, so they may run in
any order on any worker; a piece's ``load`` runs before its kernel call and its ``store``
after it, on the same worker. ``update_many`` returns only when all of them finished (or
raises). Every wait is bounded by ``timeout``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import queue
import atexit
import threading
import time
import warnings
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from .. import adamw_math
from ..adamw_math import adamw_
from ..transfer import host_empty
from ..waits import wait_until

ALIGN = 64
"""Pieces start at multiples of this many elements (see the module docstring)."""

MOMENT_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes the moments m and v may be stored in (the master is always fp32)."""

MIN_PIECE = 1 << 16
"""A batch is split finer than ``chunk_size`` so every worker gets work (about
``PIECES_PER_THREAD`` pieces each, for balance under load), but never below this many
elements: a kernel call costs some microseconds of dispatch."""

PIECES_PER_THREAD = 4

STREAM_PIECE = 1 << 19
"""Most elements of a piece whose gradient a ``PieceIO.load`` brings: the worker's scratch
(2 MiB) then stays in cache between the copy and the kernel, so the copy costs about one
extra read instead of a round trip through memory (the measurement behind the size:
docs/host.md, "Streamed pieces")."""

_POLL_S = 0.1
TIMEOUT_GRACE_S = 0.25


@dataclass(frozen=True)
class HostHyper:
    """Hyperparameters of one host update, captured at the launching step (the lr: the mean of
    the window's steps' lrs, ``host.window.window_base_lr``).

    ``grad_divisor``: the gradient is divided by it (in place, in the same pass as the
    update) first; the optimizer passes the window's step count so the update uses the
    window mean. Bit-identical to ``grad.div_(grad_divisor)`` before the update.

    ``step``: the exponent of the bias corrections ``1 - beta ** step`` (>= 1; a fraction
    when a window's betas are ``beta ** n`` and not every window held ``n`` gradients:
    ``host.window.window_betas``).

    ``adaptive_window``: 0, or the window's gradient count ``n`` when ``lr`` is still to be
    multiplied by the adaptive step size (``step_size.adaptive_multiplier``), which the job
    resolves from the moments just before the update (``resolve_adaptive``).
    ``adaptive_sums``: the statistics it reads (``step_size.sample_sums``) when the caller
    has them already: under data parallelism, summed over every rank's rows.
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int | float
    grad_divisor: float = 1.0
    adaptive_window: int = 0
    adaptive_sums: tuple[float, ...] | None = None


@dataclass(frozen=True)
class PieceIO:
    """Copies a task does piece by piece on the worker, around the kernel call.

    ``load(start, end, out)``: write the task's gradient elements ``[start, end)`` into
    ``out`` (fp32, contiguous, on the CPU, ``end - start`` elements; the worker's scratch).
    The task's own ``grad`` is then None: the gradient never exists whole on the host.
    ``store(start, end)``: ``master[start:end]`` holds its new value; copy it out.
    Either may be None. Both run on a pool worker, so they must only touch their slice.
    """

    load: Callable[[int, int, torch.Tensor], None] | None = None
    store: Callable[[int, int], None] | None = None


class HostTask(NamedTuple):
    """One set of buffers for :meth:`HostAdamW.update_many` (a plain 5- or 6-tuple in this
    order is accepted too)."""
    master: torch.Tensor
    grad: torch.Tensor | None
    m: torch.Tensor
    v: torch.Tensor
    hyper: "HostHyper"
    io: PieceIO | None = None


class HostAdamWError(RuntimeError):
    """A piece of a host AdamW update failed; the message names the task and the slice."""


# ---------------------------------------------------------------------------- OpenMP

_OMP_LOCK = threading.Lock()
_OMP: tuple | None = None
_OMP_SEARCHED = False


def _openmp() -> tuple | None:
    """``(omp_set_num_threads, omp_get_max_threads)`` of the OpenMP runtime torch loaded, or
    None (not Linux, or not found). Both act on the calling thread only: the team size is an
    OpenMP per-thread setting."""
    global _OMP, _OMP_SEARCHED
    with _OMP_LOCK:
        if _OMP_SEARCHED:
            return _OMP
        _OMP_SEARCHED = True
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split(None, 5)[5].strip() for line in f
                         if len(line.split(None, 5)) == 6}
        except OSError:
            return None
        names = ("libgomp", "libiomp5", "libomp")
        found = sorted(p for p in paths if os.path.basename(p).startswith(names))
        torch_dir = os.path.dirname(torch.__file__)
        found.sort(key=lambda p: not p.startswith(torch_dir))  # torch's own runtime first
        for path in found:
            try:
                lib = ctypes.CDLL(path)
                set_fn, get_fn = lib.omp_set_num_threads, lib.omp_get_max_threads
            except (OSError, AttributeError):
                continue
            set_fn.argtypes, set_fn.restype = [ctypes.c_int], None
            get_fn.argtypes, get_fn.restype = [], ctypes.c_int
            _OMP = (set_fn, get_fn)
            break
        return _OMP


def _worker_init() -> bool:
    """Run in each pool worker: one OpenMP thread for this thread's torch ops. Returns
    whether that took effect.

    Order matters: torch sets a new thread's OpenMP team size lazily, on the thread's first
    parallel op or ``get_num_threads()`` call (to the process-wide setting), which would undo
    an earlier ``omp_set_num_threads(1)``; so trigger that first, then set 1."""
    try:
        torch.get_num_threads()
        omp = _openmp()
        if omp is None:
            return False
        omp[0](1)
        return omp[1]() == 1
    except Exception:  # never fatal: the worker still computes the right numbers
        return False


def pin_current_thread(cores: "Sequence[int] | None") -> bool:
    """Restrict the calling thread to ``cores`` (Linux ``sched_setaffinity`` on the thread);
    returns whether it took effect. Never fatal: where the OS cannot do it, or none of the
    cores is usable, it warns and the thread runs unpinned."""
    if not cores:
        return False
    if not hasattr(os, "sched_setaffinity"):
        warnings.warn("host_cores: this platform cannot pin threads to cores; host threads "
                      "run unpinned", RuntimeWarning, stacklevel=2)
        return False
    try:
        usable = set(cores) & os.sched_getaffinity(0)
        if not usable:
            warnings.warn(f"host_cores={tuple(cores)}: none of these cores is available to this "
                          f"process ({sorted(os.sched_getaffinity(0))}); host threads run "
                          "unpinned", RuntimeWarning, stacklevel=2)
            return False
        os.sched_setaffinity(0, usable)  # pid 0 = the calling thread on Linux
        return True
    except OSError as e:
        warnings.warn(f"host_cores: pinning failed ({e}); host threads run unpinned",
                      RuntimeWarning, stacklevel=2)
        return False


# ---------------------------------------------------------------------------- the pool

_READY_TIMEOUT_S = 10.0
"""How long a new pool waits for each worker's set-up before going on without it."""


class _Pool:
    """``n`` daemon threads running submitted calls; futures carry results and errors."""

    def __init__(self, n: int, name: str, cores: "Sequence[int] | None" = None) -> None:
        self._queue: "queue.SimpleQueue[tuple | None]" = queue.SimpleQueue()
        self.local = threading.local()  # per worker: its scratch buffer
        self.single_threaded = [False] * n
        self.cores = tuple(cores) if cores else None
        self.pinned = [False] * n
        self._ready = [threading.Event() for _ in range(n)]
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}",
                                          daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()
        # each worker's set-up (pinning, one OpenMP thread) done before the pool is used, so
        # what it reports is what its work runs with (bounded: a slow start is not a hang)
        for ready in self._ready:
            ready.wait(timeout=_READY_TIMEOUT_S)

    def _run(self, i: int) -> None:
        try:
            self.pinned[i] = pin_current_thread(self.cores)
            self.single_threaded[i] = _worker_init()
        finally:
            self._ready[i].set()
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter
                fut.set_exception(e)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def close(self, timeout: float) -> None:
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------- kernels

@functools.lru_cache(maxsize=None)
def _fused_available() -> bool:
    """True when torch's fused CPU AdamW exists and agrees with ``adamw_`` on a probe."""
    if not hasattr(torch, "_fused_adamw_"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        ref = [torch.randn(67, generator=g) for _ in range(3)] + [torch.rand(67, generator=g)]
        got = [t.clone() for t in ref]
        h = HostHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=2)
        _fused_call([[t] for t in got], [h.step], h)
        adamw_math.adamw_(*ref, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
               weight_decay=h.weight_decay, step=h.step)
        return all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, ref))
    except Exception:
        return False


def _step_tensors(steps: Sequence) -> list[torch.Tensor]:
    """Adam step counts as the 0-d float tensors the fused kernel takes (it only reads them):
    ints become one shared tensor per distinct value; tensors pass through."""
    made: dict[int, torch.Tensor] = {}
    out = []
    for s in steps:
        if not isinstance(s, torch.Tensor):
            if s not in made:
                made[s] = torch.tensor(float(s))
            s = made[s]
        out.append(s)
    return out


def _fused_call(lists, steps: Sequence, h: HostHyper) -> None:
    """``steps``: per tensor, its Adam step as an int or a 0-d float tensor."""
    params, grads, ms, vs = lists
    state_steps = _step_tensors(steps)
    scale = None if h.grad_divisor == 1.0 else torch.tensor(float(h.grad_divisor))
    torch._fused_adamw_(params, grads, ms, vs, [], state_steps, lr=float(h.lr),
                        beta1=float(h.beta1), beta2=float(h.beta2),
                        weight_decay=float(h.weight_decay), eps=float(h.eps), amsgrad=False,
                        maximize=False, grad_scale=scale, found_inf=None)


def _reference_call(lists, steps: Sequence, h: HostHyper) -> None:
    for p, g, m, v, s in zip(*lists, steps):
        if h.grad_divisor != 1.0:
            g.div_(h.grad_divisor)
        adamw_(p, g, m, v, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
               weight_decay=h.weight_decay, step=float(s))


# ---------------------------------------------------------------------------- HostAdamW

_OPEN: "weakref.WeakSet[HostAdamW]" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    """Let pieces in flight finish before the interpreter tears down (see close())."""
    for adamw in list(_OPEN):
        try:
            adamw.close()
        except Exception:
            pass


class HostAdamW:
    """AdamW on (master, grad, m, v) fp32 CPU buffers with a pool of ``threads`` workers.

    Args:
        threads: worker threads (each runs torch with one OpenMP thread).
        chunk_size: most elements of one tensor one kernel call handles; rounded down to a
            multiple of ``ALIGN`` (at least ``ALIGN``). Results do not depend on it.
        timeout: seconds any ``update``/``update_many`` may wait for its pieces.
        kernel: ``"auto"`` (torch's fused CPU AdamW where available), ``"fused"`` or
            ``"reference"`` (``adamw_math.adamw_`` per piece).
        cores: CPU cores the workers are pinned to (see :func:`pin_current_thread`), or
            None to leave them where the OS puts them.
    """

    def __init__(self, threads: int, chunk_size: int, timeout: float,
                 kernel: str = "auto", cores: "Sequence[int] | None" = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if kernel not in ("auto", "fused", "reference"):
            raise ValueError(f'kernel must be "auto", "fused" or "reference", got {kernel!r}')
        self.threads = threads
        self.chunk_size = chunk_size
        self.piece_max = max(ALIGN, chunk_size // ALIGN * ALIGN)
        self.timeout = float(timeout)
        if kernel == "auto":
            kernel = "fused" if _fused_available() else "reference"
        elif kernel == "fused" and not _fused_available():
            raise RuntimeError("torch._fused_adamw_ is not usable on CPU in this torch "
                               f"{torch.__version__}; use kernel='reference'")
        self.kernel = kernel
        self._scratch_lock = threading.Lock()
        self._buffer_bytes = {"scratch": 0, "moment_scratch": 0}  # all workers' buffers
        self._pool: _Pool | None = _Pool(threads, "zenflow-host-adamw", cores)
        _OPEN.add(self)

    @property
    def workers_single_threaded(self) -> bool:
        """Whether every worker limited its OpenMP team to one thread (measured to help)."""
        pool = self._pool
        return pool is not None and all(pool.single_threaded)

    # ------------------------------------------------------------------ public
    def update(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
               v: torch.Tensor, hyper: HostHyper) -> None:
        """One AdamW step on one set of buffers, in place (``grad`` may be overwritten)."""
        self.update_many([(master, grad, m, v, hyper)])

    def update_many(self, tasks: Sequence[HostTask | tuple]) -> None:
        """AdamW steps on many sets of buffers at once, in place: ``tasks`` is a sequence of
        ``(master, grad, m, v, hyper)`` or ``(master, grad, m, v, hyper, io)``; each tensor is
        fp32, on the CPU, contiguous, of one number of elements (``grad`` may be overwritten;
        it is None when ``io.load`` brings the gradient, see :class:`PieceIO`). The pieces of
        all tasks go to the pool together. Returns when every piece is done. A piece that
        raises: the others are cancelled or finish, then its exception is re-raised (same
        type, a note naming the task and slice). TimeoutError after ``timeout`` (+
        TIMEOUT_GRACE_S) seconds."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("this HostAdamW is closed")
        flats = [self._check(i, t) for i, t in enumerate(tasks)]
        tasks = [HostTask(*t) for t in tasks]
        ios = [t.io for t in tasks]
        # Pieces of bounded size where the worker stages something: a loaded gradient, or
        # low-precision moments (widened to fp32 in the worker's scratch, rounded back).
        batches = self._plan(flats, [t.hyper for t in tasks],
                             [(io is not None and io.load is not None,
                               f[2].dtype != torch.float32) for f, io in zip(flats, ios)])
        if not batches:
            return
        if not pool.alive():
            raise HostAdamWError("a host AdamW worker thread is dead")
        # Made once per call and shared by the pieces, not once per piece.
        steps = _step_tensors([t.hyper.step for t in tasks])
        futures = [pool.submit(self._run_batch, flats, ios, steps, b) for b in batches]
        self._wait(pool, futures, batches)

    def scratch_bytes(self) -> int:
        """Bytes of the workers' scratch buffers (the bounded staging of piece-wise loads)."""
        return self._buffer_bytes["scratch"]

    def moment_scratch_bytes(self) -> int:
        """Bytes of the workers' fp32 copies of low-precision moment pieces (pageable)."""
        return self._buffer_bytes["moment_scratch"]

    def close(self) -> None:
        """Stop the workers after the work in flight; idempotent, bounded by ``timeout``."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(self.timeout)

    def __enter__(self) -> "HostAdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _check(i: int, task) -> list[torch.Tensor | None]:
        if len(task) not in (5, 6):
            raise ValueError(f"task {i}: expected (master, grad, m, v, hyper[, io]), got "
                             f"{len(task)} items")
        ts, hyper = list(task[:4]), task[4]
        io = task[5] if len(task) == 6 else None
        if not isinstance(hyper, HostHyper):
            raise TypeError(f"task {i}: hyper must be a HostHyper, got {type(hyper).__name__}")
        if (isinstance(hyper.step, bool) or not isinstance(hyper.step, (int, float))
                or not hyper.step >= 1 or not math.isfinite(hyper.step)):
            raise ValueError(f"task {i}: Adam step must be a number >= 1, got {hyper.step!r}")
        if io is not None and not isinstance(io, PieceIO):
            raise TypeError(f"task {i}: io must be a PieceIO, got {type(io).__name__}")
        loads = io is not None and io.load is not None
        if loads != (ts[1] is None):
            raise ValueError(f"task {i}: give grad=None exactly when io.load brings the "
                             "gradient")
        n = ts[0].numel()
        if ts[2].dtype != ts[3].dtype or ts[2].dtype not in MOMENT_DTYPES:
            raise TypeError(f"task {i}: m and v must both be one of "
                            f"{[str(d) for d in MOMENT_DTYPES]}, got {ts[2].dtype} and "
                            f"{ts[3].dtype}")
        for name, t in zip(("master", "grad", "m", "v"), ts):
            if t is None:
                continue
            want = ts[2].dtype if name in ("m", "v") else torch.float32
            if t.dtype != want or not t.is_cpu:
                short = {torch.float32: "fp32", torch.bfloat16: "bf16"}[want]
                raise TypeError(f"task {i}: {name} must be {short} on the CPU, got {t.dtype} "
                                f"on {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"task {i}: {name} must be contiguous")
            if t.numel() != n:
                raise ValueError(f"task {i}: {name} has {t.numel()} elements, master has {n}")
        return [t if t is None or t.dim() == 1 else t.view(-1) for t in ts]

    def _plan(self, flats, hypers, loads) -> list[tuple]:
        """Split the tasks into pieces and pack them into batches (one kernel call each).

        A piece is ``(task, start, end)`` with ``start`` a multiple of ALIGN; a batch holds
        pieces whose hyperparameters (all but the step, which the kernel takes per tensor)
        agree, filled to ``capacity`` elements, so many small tensors (or tiny pieces) share one
        call; each piece is its own tensor in the call, so the split stays as planned. A task
        whose gradient is loaded piece by piece gets pieces of at most STREAM_PIECE."""
        total = sum(f[0].numel() for f in flats)
        if total == 0:
            return []
        want = math.ceil(total / (self.threads * PIECES_PER_THREAD))
        piece = min(self.piece_max, max(MIN_PIECE, -(-want // ALIGN) * ALIGN))
        # Tiny pieces (a small chunk_size) share a kernel call, up to the share of a thread.
        capacity = max(piece, min(MIN_PIECE, want))
        batches: list[tuple] = []
        open_batch: dict[tuple, list] = {}  # key -> [pieces, elements]
        for ti, (f, h, load) in enumerate(zip(flats, hypers, loads)):
            n = f[0].numel()
            key = (h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.grad_divisor, load)
            staged = any(load)
            step = min(piece, STREAM_PIECE) if staged else piece
            cap = min(capacity, STREAM_PIECE) if staged else capacity  # >= step
            s = 0
            while s < n:
                cur = open_batch.get(key)
                if cur is None or cap - cur[1] < ALIGN:
                    cur = open_batch[key] = [[], 0]
                    batches.append((h, cur[0]))
                room = cap - cur[1]
                # Fill the batch to its capacity, splitting a tensor at an ALIGN boundary if
                # need be: batches of equal size balance the workers.
                e = min(n, s + step) if n - s <= room else min(s + step, s + room // ALIGN * ALIGN)
                cur[0].append((ti, s, e))
                cur[1] += e - s
                s = e
        return batches

    def _run_batch(self, flats, ios, steps, batch) -> None:
        hyper, pieces = batch
        lists: list[list[torch.Tensor]] = [[], [], [], []]

        def padded(s: int, e: int) -> int:
            return -(-(e - s) // ALIGN) * ALIGN  # pieces start ALIGN-aligned in a scratch

        need = sum(padded(s, e) for ti, s, e in pieces
                   if ios[ti] is not None and ios[ti].load is not None)
        scratch = self._scratch(need) if need else None
        need_m = sum(padded(s, e) for ti, s, e in pieces if flats[ti][2].dtype != torch.float32)
        mscratch = self._moment_scratch(2 * need_m) if need_m else None
        narrow: list[tuple] = []  # (m piece, v piece, their fp32 copies): rounded back after
        off = off_m = 0
        for ti, s, e in pieces:
            master, grad, m, v = flats[ti]
            io = ios[ti]
            if io is not None and io.load is not None:
                grad = scratch[off:off + (e - s)]
                off += padded(s, e)
                io.load(s, e, grad)
                lists[1].append(grad)
            elif s == 0 and e == grad.numel():  # a whole tensor: no views to make
                lists[1].append(grad)
            else:
                lists[1].append(grad[s:e])
            whole = s == 0 and e == master.numel()
            lists[0].append(master if whole else master[s:e])
            if m.dtype != torch.float32:  # widened (exactly) into the worker's scratch
                m32 = mscratch[off_m:off_m + (e - s)]
                v32 = mscratch[off_m + padded(s, e):off_m + padded(s, e) + (e - s)]
                off_m += 2 * padded(s, e)
                m32.copy_(m[s:e])
                v32.copy_(v[s:e])
                narrow.append((m[s:e], v[s:e], m32, v32))
                lists[2].append(m32)
                lists[3].append(v32)
            else:
                lists[2].append(m if whole else m[s:e])
                lists[3].append(v if whole else v[s:e])
        call = _fused_call if self.kernel == "fused" else _reference_call
        call(lists, [steps[ti] for ti, _, _ in pieces], hyper)
        for m, v, m32, v32 in narrow:  # rounded to nearest, once per step
            m.copy_(m32)
            v.copy_(v32)
        for ti, s, e in pieces:
            io = ios[ti]
            if io is not None and io.store is not None:
                io.store(s, e)

    def _scratch(self, n: int) -> torch.Tensor:
        """This worker's scratch buffer of at least ``n`` fp32 elements for loaded gradient
        pieces (pinned where CUDA exists: a piece may be copied from the device into it)."""
        return self._worker_buffer("scratch", n, host_empty)

    def _moment_scratch(self, n: int) -> torch.Tensor:
        """This worker's fp32 buffer of at least ``n`` elements for low-precision moments
        (pageable: it never crosses the link)."""
        return self._worker_buffer("moment_scratch", n, torch.empty)

    def _worker_buffer(self, name: str, n: int, alloc) -> torch.Tensor:
        """This worker's fp32 buffer ``name`` of at least ``n`` elements, made by
        ``alloc((n,))`` and kept for the next batch (at most one batch's worth: ``_plan``
        bounds it); its bytes are counted in ``self._buffer_bytes[name]``."""
        local = self._pool.local
        buf = getattr(local, name, None)
        if buf is None or buf.numel() < n:
            old = 0 if buf is None else buf.numel() * 4
            buf = alloc((n,))
            setattr(local, name, buf)
            with self._scratch_lock:
                self._buffer_bytes[name] += n * 4 - old
        return buf

    def _wait(self, pool: _Pool, futures: list[Future], batches) -> None:
        # TIMEOUT_GRACE: a caller that waits for this call with the same timeout (the
        # optimizer's host worker) reports the timeout itself, first.
        budget = self.timeout + TIMEOUT_GRACE_S
        deadline = time.monotonic() + budget
        left = [set(futures)]

        def finished(poll_s: float) -> bool:
            done, left[0] = wait(left[0], timeout=poll_s, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for f in left[0]:
                    f.cancel()
                # Let the pieces already running finish before the caller touches the
                # buffers again (bounded by the same deadline).
                wait(left[0], timeout=max(0.0, deadline - time.monotonic()))
                f = min(failed, key=futures.index)
                exc = f.exception()
                ti, s, e = batches[futures.index(f)][1][0]
                if hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"(in host AdamW: the kernel call on task {ti}, elements "
                                 f"[{s}:{e}), and the pieces batched with it)")
                raise exc
            return not left[0]

        def alive() -> None:
            if not pool.alive():
                raise HostAdamWError("a host AdamW worker thread died")

        def timed_out() -> BaseException:
            for f in left[0]:
                f.cancel()
            return TimeoutError(f"host AdamW did not finish {len(left[0])} of "
                                f"{len(futures)} pieces within timeout={self.timeout} s")

        wait_until(finished, budget, timed_out, poll_s=_POLL_S, check=alive)
