"""The lifetime of an optimizer's host threads: tied to the optimizer object, stopped by
close() (or a ``with`` block), by collection, or at interpreter exit after the work in
flight; and what a copy of an optimizer keeps (nothing that runs)."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

_OPEN: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_optimizers() -> None:
    """A script that ends without close() while a host job is in flight would otherwise abort
    the process at exit (a worker thread still inside a torch kernel while the runtime tears
    down). atexit runs before that: wait for the work (bounded) and stop the threads."""
    for opt in list(_OPEN):
        try:
            opt._stop()  # nothing can be saved any more: stop, apply nothing
        except Exception:  # never turn a clean exit into an error
            pass


def _stop_threads(worker, host_adamw) -> None:
    """Stop an optimizer's host threads: the worker first (it finishes its queued job, which
    uses the pool), then the pool. Bounded by host_timeout; idempotent."""
    worker.close()
    host_adamw.close()


class HostThreads:
    """Mixed into the optimizer (before ``torch.optim.Optimizer``); expects ``_pipeline``."""

    def _own_threads(self, worker, host_adamw) -> None:
        # The threads live as long as this object, not as long as whoever holds a copy of
        # its __dict__: wrappers (Lightning's LightningOptimizer, copy.copy, profilers) share
        # the worker and pool, and collecting such a wrapper must not stop them. A finalizer
        # bound to this object (never __del__, which a wrapper inherits) stops them when the
        # owner is collected, and close() runs it early; it holds the threads, not self.
        self._closed = False
        self._shutdown = weakref.finalize(self, _stop_threads, worker, host_adamw)
        self._shutdown.atexit = False  # _close_open_optimizers waits for the work first
        _OPEN.add(self)

    def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        """Stop the host threads (after waiting for work in flight); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if not any(not getattr(o, "_closed", True) for o in list(_OPEN) if o is not self):
            from .guards.faults import release_sigint
            release_sigint()  # the last open optimizer: SIGINT's handler as it was
        stream = getattr(self, "_stream", None)
        if stream is not None:  # gradients stay in .grad from now on
            stream.remove()
        try:
            self._pipeline.wait()
        except Exception:  # closing must not raise for a job that already failed
            pass
        finally:
            self._pipeline.abandon()  # the worker finishes queued jobs before it stops
            self._shutdown()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # an exception is on its way out: stop the threads, change nothing
            self._stop()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """copy.copy, copy.deepcopy and pickle keep torch's part of an optimizer only
        (defaults, state, param_groups): no host threads, no step count, no pending work. Such
        a copy is inert: it refuses to step or save, saying so, instead of failing later."""
        super().__setstate__(state)
        self._closed = True
        self._detached = True
        self._training = True

    def _check_open(self) -> None:
        if getattr(self, "_detached", False):
            raise RuntimeError(
                "this ZenFlowOptimizer is a copy made by copy/deepcopy/pickle, which keep only "
                "its param_groups and state (no host threads, step count or pending host "
                "work); to duplicate or move one, build a new ZenFlowOptimizer and call "
                "load_state_dict(old.state_dict())")
        if self._closed:
            raise RuntimeError("this ZenFlowOptimizer is closed")
