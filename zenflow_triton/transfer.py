"""Device <-> host copies, and the count of every byte that crosses the link.

Host memory is pinned where CUDA exists (``pin_memory=True`` raises on a CPU-only torch).
On a CPU-only run "device" and host are the same memory, but the copies are still made
(the host works on its own buffers while the training loop goes on) and counted as the bytes
that would cross the link.

The host job's own copies go through a :class:`CopyQueue` (see there): on CUDA the link's
copy streams of each device, one per direction, ordered after the work queued before the
job was launched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import torch

from .waits import wait_until

if TYPE_CHECKING:
    import numpy as np

_POLL_S = 1e-4
BOUNCE_ELEMS = 1 << 20
"""Elements per trip through a bounce buffer (see :meth:`CopyQueue.copy`)."""


def host_can_pin() -> bool:
    return torch.cuda.is_available()


def host_empty(shape, dtype=torch.float32) -> torch.Tensor:
    """Uninitialised host buffer for the link (a copy reads or writes it across the link),
    pinned where CUDA exists. Host *state* (master, moments, a host accumulator) is plain
    pageable memory: :func:`state_empty`."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=host_can_pin())


def state_empty(shape, dtype=torch.float32) -> torch.Tensor:
    """Uninitialised pageable host memory, for state no copy reads across the link."""
    return torch.empty(shape, dtype=dtype, device="cpu")


def state_zeros(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device="cpu")


def to_host_memory(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A pageable host copy of ``t`` (host state), not counted: for loading state. A host
    ``t`` of that dtype is copied too (the caller's tensor is never adopted)."""
    out = state_empty(t.shape, dtype or t.dtype)
    out.copy_(t)
    return out


def wait_event(event, timeout: float, what: str) -> None:
    """Block the calling thread until a CUDA ``event`` is reached, polling; TimeoutError after
    ``timeout`` seconds naming ``what``. Every wait on a copy goes through here."""
    wait_until(lambda poll_s: event.query() or time.sleep(poll_s), timeout,
               lambda: TimeoutError(f"{what} did not finish within {timeout} s"),
               poll_s=_POLL_S)


class CudaStreams:
    """The stream operations the link orders its copies with: CUDA's. Every ordering call of
    this module goes through one of these methods, so a test can put a recording fake in
    their place and check the order on a CPU-only machine (``tests/test_stream_order.py``);
    the link and its copy queues hold one (``Link(streams=...)``)."""

    def owns(self, device: torch.device) -> bool:
        """Whether ``device``'s copies are ordered on streams (else they are made at once)."""
        return device.type == "cuda"

    def canonical(self, device: torch.device) -> torch.device:
        """``device`` with its index (a bare ``cuda`` is the current one)."""
        return torch.device(device.type, device.index if device.index is not None
                            else torch.cuda.current_device())

    def new_stream(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device):
        """The stream the training thread queues its work on."""
        return torch.cuda.current_stream(device)

    def use(self, stream):
        """Context: work issued inside runs on ``stream``."""
        return torch.cuda.stream(stream)

    def record(self, stream):
        """An event reached when the work queued so far on ``stream`` is done."""
        return stream.record_event()

    def wait(self, stream, event) -> None:
        """``stream`` waits (on the device) for ``event`` before its next work."""
        stream.wait_event(event)

    def keep_alive(self, t: torch.Tensor, stream) -> None:
        """``t``'s memory is not reused before the work queued on ``stream`` is done."""
        t.record_stream(stream)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` across the link without blocking the calling thread, on the
        stream in use: done once an event recorded there after it is reached. Every
        non-blocking device-to-host copy of this module goes through here, so a test can put
        a link whose copies land later, on another thread, in its place
        (``tests/support/async_link.py``)."""
        dst.copy_(src, non_blocking=True)


CUDA_STREAMS = CudaStreams()


class Link:
    """Counts bytes per direction, and the training thread's transfers by kind; thread-safe
    (the host worker copies too).

    ``blocking_transfers`` counts the copies made through :meth:`to_host` and blocking
    :meth:`to_device` calls: on a GPU the calling thread waits for each (and for the work
    queued before it), so a step's count is what a CPU run cannot time.
    ``async_transfers`` counts the copies that do not block the calling thread
    (:meth:`to_host_async`, :meth:`to_device_async`, :meth:`indices_to_device`). Both count
    on a CPU-only run too, where the copy may be skipped: they describe the GPU path.
    """

    def __init__(self, streams: CudaStreams = CUDA_STREAMS) -> None:
        self.streams = streams  # how copies are ordered (CUDA's; a fake in ordering tests)
        self._lock = threading.Lock()
        self._streams: dict[tuple[torch.device, str], object] = {}
        self._local = threading.local()  # per thread: its bounce buffers, by dtype
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.blocking_transfers = 0
        self.async_transfers = 0
        self._bounce_bytes = 0

    def _count(self, d2h: int = 0, h2d: int = 0, blocking: int = 0, async_: int = 0) -> None:
        with self._lock:
            self.bytes_d2h += d2h
            self.bytes_h2d += h2d
            self.blocking_transfers += blocking
            self.async_transfers += async_

    def to_host(self, src: torch.Tensor, dtype: torch.dtype | None = None,
                pin: bool = True) -> torch.Tensor:
        """Copy a device tensor into new host memory (cast after the transfer: the link
        carries ``src``'s dtype). ``pin=False``: into pageable memory (host state; a slower
        copy, for one-off transfers: no pinned block is left cached)."""
        self._count(d2h=src.numel() * src.element_size(), blocking=1)
        out = (host_empty if pin else state_empty)(src.shape, src.dtype)
        out.copy_(src, non_blocking=False)
        return out if dtype is None or dtype == src.dtype else out.to(dtype)

    def to_device(self, src: torch.Tensor, device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """``src`` on ``device``, a blocking copy (:meth:`to_device_async` for one that is
        not); cast on the host first when ``dtype`` is given (the link carries the narrower
        type). The result may be ``src`` itself where host and device are one memory:
        callers only read it or own it."""
        if dtype is not None and dtype != src.dtype:
            src = src.to(dtype)
        self._count(h2d=src.numel() * src.element_size(), blocking=1)
        if src.device == torch.device(device):
            return src  # CPU-only run: the "device" already holds it; counted all the same
        return src.to(device, non_blocking=False)

    def to_host_async(self, src: torch.Tensor):
        """A host copy of ``src`` that does not block the calling thread: returns the host
        tensor (pinned where CUDA exists) and ``wait(timeout)``, which blocks (bounded) until
        the copy is done; whoever reads the copy calls it first.

        Ordering invariant (CUDA): the copy runs on this link's copy stream of ``src``'s
        device, after the work queued so far on the current stream (so it reads ``src``
        after the kernels that wrote it) and never behind work queued later; ``src``'s
        memory is not reused before the copy is done (``record_stream``). On CPU the copy is
        made at once and ``wait`` returns at once."""
        self._count(d2h=src.numel() * src.element_size(), async_=1)
        out = host_empty(src.shape, src.dtype)
        if not self.streams.owns(src.device):
            out.copy_(src)
            return out, lambda timeout: None
        with self._down_stream(src.device) as stream:
            self.streams.copy_async(out, src)
            done = self.streams.record(stream)
        self.streams.keep_alive(src, stream)

        def wait(timeout: float) -> None:
            wait_event(done, timeout, "a device-to-host copy")
        return out, wait

    def to_device_async(self, src: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``src`` (pinned host memory, already complete) on ``device``, copied on this link's
        host-to-device stream so the copy does not wait behind the work queued on the
        training stream; the training stream waits for the copy before its next work (the
        apply's scatter), and the result's memory is kept until that work is done. Whoever
        rewrites ``src`` next waits for the training stream's work queued so far
        (``CopyQueue.wait_launched``). CPU: ``src`` itself. Counted as non-blocking. The
        result is allocated from the copy stream's pool, so after it is freed that block
        serves the copy stream's next allocation (about one arena per dtype stays cached
        there)."""
        self._count(h2d=src.numel() * src.element_size(), async_=1)
        device = torch.device(device)
        if not self.streams.owns(device):
            if src.device == device:
                return src  # CPU-only run: the "device" already holds it
            return src.to(device, non_blocking=True)
        if host_can_pin() and src.numel() and not src.is_pinned():  # empty: nothing to pin
            raise ValueError("to_device_async: a non-blocking copy needs a pinned source")
        stream = self._stream(device, "h2d")
        with self.streams.use(stream):
            out = src.to(device, non_blocking=True)
            done = self.streams.record(stream)
        current = self.streams.current(device)
        self.streams.wait(current, done)
        self.streams.keep_alive(out, current)
        return out

    def indices_to_device(self, idx: "np.ndarray", device: torch.device) -> torch.Tensor:
        """A host index array (numpy int64) on ``device``, by :meth:`to_device_async` from a
        fresh pinned block (nothing rewrites it), counted."""
        return self.to_device_async(pinned(torch.from_numpy(idx)), device)

    def count_d2h(self, nbytes: int) -> None:
        self._count(d2h=nbytes)

    def count_h2d(self, nbytes: int) -> None:
        self._count(h2d=nbytes)

    def copy_in(self, pairs) -> "CopyIn":
        """Issue a host job's copy-in now, on the launching thread: see :class:`CopyIn`."""
        return CopyIn(self, pairs)

    def copy_queue(self, devices, timeout: float) -> "CopyQueue":
        """A :class:`CopyQueue` for one host job touching ``devices``; call it on the thread
        that queued the work the job's copies depend on (the training loop), at launch."""
        return CopyQueue(self, devices, timeout)

    def _bounce(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The calling thread's host buffer of ``n`` elements of ``dtype`` (pinned where CUDA
        exists), reused across calls."""
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(dtype)
        if buf is None or buf.numel() < n:
            old = 0 if buf is None else buf.numel() * buf.element_size()
            buf = bufs[dtype] = host_empty((max(n, 1),), dtype)
            with self._lock:
                self._bounce_bytes += buf.numel() * buf.element_size() - old
        return buf[:n]

    def bounce_bytes(self) -> int:
        """Bytes of every thread's bounce buffers (link buffers: pinned where CUDA exists)."""
        return self._bounce_bytes

    @contextlib.contextmanager
    def _down_stream(self, device: torch.device):
        """Run the body on this link's device-to-host copy stream of ``device``, after the
        work queued so far on its current stream (the kernels that wrote what is copied);
        yields the stream."""
        stream = self._stream(device, "d2h")
        self.streams.wait(stream, self.streams.record(self.streams.current(device)))
        with self.streams.use(stream):
            yield stream

    def _stream(self, device: torch.device, direction: str):
        """This link's copy stream of ``direction`` ("d2h" or "h2d") on a CUDA ``device``
        (created once, then reused): one per direction, so a copy up never queues behind a
        copy down."""
        key = (torch.device(device), direction)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = self.streams.new_stream(device)
            return self._streams[key]


class CopyIn:
    """A host job's copy-in: device sources into host buffers, issued at launch. Each pair
    may ask for its source to be divided first (a window sum into its mean, in place: the
    source is a window accumulator, zeroed after its copy) and is cast into the host
    buffer's dtype *before* it crosses (the link carries the host buffer's dtype: a bf16
    param's window mean crosses and is staged as bf16, rounded once).

    Ordering invariant (CUDA): made on the training thread at launch, each copy (and its
    divide, cast and zero) of a CUDA source runs on the link's device-to-host stream of its
    device, after the work queued before the launch, non-blocking into pinned host memory;
    one event per device marks the copies done. The job's thread waits for those events
    (bounded) before it reads a buffer (:meth:`wait_on_host`); the training stream waits
    for them before it next writes a source (:meth:`release`, a device-side wait: the
    training thread does not block); a source's memory is not reused before its copy is
    done (``record_stream``). CPU sources: the job's thread makes the copies in
    :meth:`wait_on_host` (the training thread goes on), and whoever next writes a source
    waits for that on the host (:attr:`host_side`).
    """

    def __init__(self, link: Link, pairs) -> None:
        """``pairs``: ``(host dst, device src, zero src, divisor or None)``, dst contiguous
        with as many elements as src."""
        self._host: list = []  # CPU sources, copied by the job's thread
        self._done: dict[torch.device, object] = {}  # CUDA: device -> event, set once
        self._released = False
        self._ops = link.streams
        by_device: dict[torch.device, list] = {}
        for dst, src, zero, divisor in pairs:
            if dst.numel() != src.numel():
                raise ValueError(f"copy-in: {tuple(src.shape)} into {tuple(dst.shape)}")
            if divisor is not None and not zero:
                raise ValueError("copy-in: only a source that is zeroed after its copy (an "
                                 "accumulator) may be divided in place")
            link._count(d2h=dst.numel() * dst.element_size(), async_=1)
            if link.streams.owns(src.device):
                by_device.setdefault(src.device, []).append((dst, src, zero, divisor))
            else:
                self._host.append((dst, src, zero, divisor))
        for dev, members in by_device.items():
            with link._down_stream(dev) as stream:
                for dst, src, zero, divisor in members:
                    link.streams.copy_async(dst.view(-1), self._wire(src, dst.dtype, divisor))
                    if zero:
                        src.zero_()
                    link.streams.keep_alive(src, stream)
                self._done[dev] = link.streams.record(stream)

    @staticmethod
    def _wire(src: torch.Tensor, dtype: torch.dtype, divisor) -> torch.Tensor:
        """What crosses: ``src`` (flat) divided in place by ``divisor``, cast to ``dtype`` (a
        new tensor on the current stream, freed after the copy: the caching allocator keeps
        it for that stream's next one)."""
        flat = src.reshape(-1)
        if divisor is not None and divisor != 1.0:
            # True division in fp32, as the host does: CUDA divides a tensor by a Python
            # number as a multiplication by its reciprocal (1 ulp apart), by a tensor not.
            d = (torch.full((), float(divisor), dtype=torch.float32, device=flat.device)
                 if flat.is_cuda else float(divisor))
            if flat.dtype not in (torch.float32, dtype):  # e.g. a bf16 sum, an fp16 param:
                return flat.float().div_(d).to(dtype)      # fp32 mean, rounded once
            flat.div_(d)  # fp32 math, rounded once where the sum is bf16 (and so is dtype)
        return flat if flat.dtype == dtype else flat.to(dtype)

    @property
    def host_side(self) -> bool:
        """Some copies are the job thread's (CPU sources): a writer of a source must wait for
        the job to say they are done."""
        return bool(self._host)

    def wait_on_host(self, timeout: float) -> None:
        """On the job's thread, before it reads a buffer: make the CPU copies, wait (bounded)
        for the CUDA ones."""
        for dst, src, zero, divisor in self._host:
            dst.view(-1).copy_(self._wire(src, dst.dtype, divisor))
            if zero:
                src.zero_()
        for event in self._done.values():
            wait_event(event, timeout, "the copy-in of a host job")

    def release(self) -> None:
        """On the training thread, before it next writes a CUDA source: its current stream
        waits for the copies (no host wait). Once is enough."""
        if self._released:
            return
        self._released = True
        for dev, event in self._done.items():  # read-only here and in wait_on_host
            self._ops.wait(self._ops.current(dev), event)


class CopyQueue:
    """The device copies of one host job, ordered after what was queued before its launch.

    Ordering invariant (CUDA): created on the launching thread, it records an event on each
    device's current stream and makes the link's copy streams of that device (one per
    direction: gradients down, params up) wait for it. So
    a copy reads a gradient only after the kernels that wrote it, and writes a param only
    after the kernels queued before the launch that use it; and it never waits for kernels
    the training loop queues later (as a copy on the default stream would). Each copy blocks
    the calling host thread until it is done (host buffers are pinned, so these are DMA
    transfers); an async device-side op (``zero_``) is complete after :meth:`flush`. Every
    wait polls with ``timeout``. On CPU every method is a plain synchronous op.
    """

    def __init__(self, link: Link, devices, timeout: float) -> None:
        self.timeout = float(timeout)
        self._link = link
        self._ops = ops = link.streams
        self._streams: dict[tuple[torch.device, str], object] = {}
        self._used: set[tuple[torch.device, str]] = set()
        self._launched: list = []  # per device: the event recorded at launch, until reached
        for dev in {torch.device(d) for d in devices}:
            if not ops.owns(dev):
                continue
            dev = ops.canonical(dev)
            launched = ops.record(ops.current(dev))
            for direction in ("d2h", "h2d"):
                stream = link._stream(dev, direction)
                ops.wait(stream, launched)
                self._streams[(dev, direction)] = stream
            self._launched.append(launched)

    def wait_launched(self) -> None:
        """Block the calling (host) thread until the work the training thread queued before
        this queue was made is done: the non-blocking copies that read a host buffer this
        job is about to rewrite (an outbox applied at an earlier boundary). Bounded; a no-op
        on CPU and once reached."""
        for event in self._launched:
            wait_event(event, self.timeout, "work queued before the host job")
        self._launched = []

    def _on(self, dst: torch.Tensor, src: torch.Tensor | None = None):
        """The copy stream for writing ``dst`` from ``src``: up ("h2d") when the destination
        is on the device, down ("d2h") when only the source is; none on CPU."""
        if self._ops.owns(dst.device):  # a tensor's device has its index: a key as made
            return self._use((dst.device, "h2d"))
        if src is not None and self._ops.owns(src.device):
            return self._use((src.device, "d2h"))
        return contextlib.nullcontext()

    def _use(self, key):
        """Run on the copy stream ``key`` (device, direction), which flush() then waits for:
        only the streams this job used, not work other jobs queue on them later."""
        self._used.add(key)
        return self._ops.use(self._streams[key])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` (with a cast), done when it returns. Across the link with a
        cast, the link carries the device side's dtype and the host casts (a bf16 gradient
        crosses as bf16, a bf16 param's update is cast from the fp32 master before it
        crosses): see :meth:`copy_cast_on_host`."""
        with self._on(dst, src):
            host = dst if dst.device.type == "cpu" else src
            if dst.device.type != src.device.type and (
                    dst.dtype != src.dtype or (host_can_pin() and not host.is_pinned())):
                self.copy_cast_on_host(dst, src)  # pageable host state: through the bounce
                return
            dst.copy_(src)
            if self._ops.owns(dst.device) and self._ops.owns(src.device):
                self.flush()  # device to device: make it done, like the others

    def copy_cast_on_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` through the calling thread's pinned bounce buffer in the device
        side's dtype, ``BOUNCE_ELEMS`` at a time: one same-dtype transfer and one host cast
        per trip. (A plain blocking ``copy_`` would cast on the destination: an H2D copy
        would then carry fp32, and a D2H copy would land in unpinned memory.) ``dst`` must
        be contiguous."""
        if not dst.is_contiguous():
            raise ValueError("copy_cast_on_host needs a contiguous destination")
        if dst.shape != src.shape:
            raise ValueError(f"shape mismatch: dst {tuple(dst.shape)}, src {tuple(src.shape)}")
        wire = src.dtype if src.device.type != "cpu" else dst.dtype
        d, s = dst.view(-1), src.reshape(-1)
        n = d.numel()
        for a in range(0, n, BOUNCE_ELEMS):
            b = min(a + BOUNCE_ELEMS, n)
            bounce = self._link._bounce(wire, b - a)
            bounce.copy_(s[a:b])  # D2H: the transfer; H2D: the host cast
            d[a:b].copy_(bounce)  # D2H: the host cast; H2D: the transfer

    def zero_(self, t: torch.Tensor) -> None:
        """``t.zero_()`` of a source the job copied down, on the down stream, so in order
        after that copy; done after flush()."""
        ctx = (self._use((t.device, "d2h")) if self._ops.owns(t.device)
               else contextlib.nullcontext())
        with ctx:
            t.zero_()

    def flush(self) -> None:
        """Wait until everything this job queued on the copy streams is done (bounded)."""
        for stream in (self._streams[key] for key in self._used):
            wait_event(self._ops.record(stream), self.timeout, "device copies")


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where pinning is impossible, else a pinned copy (a link buffer)."""
    if not host_can_pin() or t.is_pinned():
        return t
    out = host_empty(t.shape, t.dtype)
    out.copy_(t)
    return out
