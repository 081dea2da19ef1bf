"""A background thread that runs host jobs in submission order.

Ordering invariant: jobs run one at a time, in the order submitted. The optimizer hands a
job only buffers that nothing else touches until it has waited for that job (the window's
gradient copy, the host master and moments of the host-owned columns), so the results do
not depend on when the thread runs: only on the order, which is the step order.

Every wait is bounded: it polls the job's completion with a short timeout, checks that the
thread is alive, and gives up after ``timeout`` seconds with TimeoutError.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Callable

from ..waits import wait_until

_POLL_S = 0.05


class HostWorkerError(RuntimeError):
    """Host work failed or the host worker died; the message carries the original traceback."""


class HostJob:
    def __init__(self, fn: Callable[[], None], label: str) -> None:
        self.fn = fn
        self.label = label
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.error_tb: str = ""
        self.busy_seconds = 0.0


class HostWorker:
    def __init__(self, timeout: float, name: str = "zenflow-host") -> None:
        self.timeout = timeout
        self._queue: "queue.Queue[HostJob | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                job.fn()
            except BaseException as e:  # surfaced to the caller by wait()
                job.error = e
                job.error_tb = traceback.format_exc()
            finally:
                job.busy_seconds = time.perf_counter() - t0
                job.fn = None  # what it captured (host buffers) is freed now, not when the
                job.done.set()  # job object is dropped (a list of finished jobs keeps it)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], None], label: str) -> HostJob:
        if self._closed:
            raise HostWorkerError("the host worker is closed (optimizer.close() was called)")
        if not self.alive:
            raise HostWorkerError("the host worker thread is dead")
        job = HostJob(fn, label)
        self._queue.put(job)
        return job

    def wait_event(self, event: threading.Event, label: str) -> None:
        """Block until the worker sets ``event``; bounded by ``timeout`` and by the worker's
        liveness."""
        def check() -> None:
            if not self.alive:
                raise HostWorkerError(f"the host worker thread died before finishing {label}")

        wait_until(event.wait, self.timeout,
                   lambda: TimeoutError(f"host work {label} did not finish within "
                                        f"host_timeout={self.timeout} s"),
                   poll_s=_POLL_S, check=check)

    def wait(self, job: HostJob) -> None:
        """Block until ``job`` finishes; raise HostWorkerError if it failed or the worker died."""
        self.wait_event(job.done, job.label)
        if isinstance(job.error, TimeoutError):  # a bounded wait inside the job ran out
            raise TimeoutError(f"host work {job.label} timed out: {job.error}") from job.error
        if job.error is not None:
            raise HostWorkerError(
                f"host work {job.label} failed: {job.error!r}\n"
                f"--- host worker traceback ---\n{job.error_tb}") from job.error

    def close(self) -> None:
        """Stop the thread after the queued jobs; idempotent, bounded."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout)
