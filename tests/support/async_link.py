"""A link whose copies land later, on another thread: the asynchrony of CUDA copy streams on a
CPU-only machine.

On CPU the real link copies at once, so a reader that forgot to wait for a copy still reads
it complete. :class:`AsyncLink` takes the place of ``transfer.CudaStreams`` (the seam every
ordering call and every non-blocking copy of ``transfer.py`` goes through; CPU tensors play
the device's) and makes each non-blocking copy (``copy_async``) land later:

* the copy reads its source when issued (the stream order makes that so on CUDA: whoever
  writes the source next waits for the copy; ``tests/test_stream_order.py`` checks that
  order), and its destination holds NaN (or -1) until it lands;
* copies land in the order issued, on the link's own thread, and only once someone waits
  for them (each ``latency`` seconds after it is asked for): an event (``record``) is reached
  when every copy issued before it has landed, and polling it (``query``, what
  ``transfer.wait_event`` does) asks the thread to land them.
  A link that lands nothing unless waited for is the slowest link there is: a reader that
  skips a wait reads NaN, and a writer that never waits piles copies up;
* the device memory a copy holds until it lands (its source, kept by ``record_stream`` on
  CUDA) is counted: :attr:`in_flight_bytes` now and :attr:`peak_in_flight_bytes`.

Blocking copies (``copy_`` without ``non_blocking``) are made at once, as on CUDA.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from zenflow_triton import transfer


class Event:
    """Reached once the link has landed its first ``seq`` copies."""

    def __init__(self, link: "AsyncLink", seq: int) -> None:
        self.link, self.seq = link, seq

    def query(self) -> bool:
        return self.link._reached(self.seq)


class AsyncLink(transfer.CudaStreams):
    """Copy streams and events whose copies land later, on another thread (see the module)."""

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency
        self._cond = threading.Condition()
        self._queue: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []
        self._issued = 0      # copies issued so far
        self._landed = 0      # copies landed so far (in order)
        self._wanted = 0      # land at least this many
        self._streams = 0
        self._closed = False
        self.in_flight_bytes = 0
        self.peak_in_flight_bytes = 0
        self.waits = 0        # polls of an event not yet reached
        self._thread = threading.Thread(target=self._run, name="fake-copy-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the streams interface
    def owns(self, device: torch.device) -> bool:
        return True  # CPU tensors play the accelerator's

    def canonical(self, device: torch.device) -> torch.device:
        return torch.device(device)

    def new_stream(self, device: torch.device) -> str:
        self._streams += 1
        return f"copy{self._streams}"

    def current(self, device: torch.device) -> str:
        return "current"

    def use(self, stream):
        return contextlib.nullcontext()

    def record(self, stream) -> Event:
        with self._cond:
            return Event(self, self._issued)

    def wait(self, stream, event) -> None:
        pass  # a device-side wait: copies are issued in order and read their source at once

    def keep_alive(self, t: torch.Tensor, stream) -> None:
        pass  # counted in copy_async instead

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"copy_async: {tuple(src.shape)} into {tuple(dst.shape)}")
        snapshot = src.detach().clone()
        nbytes = src.numel() * src.element_size()
        dst.fill_(float("nan") if dst.is_floating_point() else -1)  # not there yet
        with self._cond:
            self._issued += 1
            self._queue.append((self._issued, dst, snapshot, nbytes))
            self.in_flight_bytes += nbytes
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)

    # ------------------------------------------------------------ for tests
    def reset_peak(self) -> None:
        with self._cond:
            self.peak_in_flight_bytes = self.in_flight_bytes

    @property
    def pending(self) -> int:
        """Copies issued and not landed."""
        with self._cond:
            return self._issued - self._landed

    def drain(self, timeout: float = 10.0) -> None:
        """Land every copy issued so far (what the end of a CUDA stream's work would do)."""
        transfer.wait_event(self.record("copy"), timeout, "the fake link's copies")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10.0)

    # ------------------------------------------------------------ the copy engine
    def _reached(self, seq: int) -> bool:
        with self._cond:
            if self._landed >= seq:
                return True
            self.waits += 1
            if seq > self._wanted:
                self._wanted = seq
                self._cond.notify_all()
            return False

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._wanted > self._landed)
                if self._closed:
                    return
                seq, dst, src, nbytes = self._queue.pop(0)
            if self.latency:
                time.sleep(self.latency)
            dst.view(-1).copy_(src.reshape(-1))
            with self._cond:
                self._landed = seq
                self.in_flight_bytes -= nbytes


def install(opt, latency: float = 0.0) -> AsyncLink:
    """Put an :class:`AsyncLink` under ``opt``'s link (before its first copy across it);
    ``opt.close()`` does not stop the fake: call its ``close()``."""
    fake = AsyncLink(latency)
    assert not opt.link._streams, "install the fake before the link made its streams"
    opt.link.streams = fake
    return fake
