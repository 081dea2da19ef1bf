"""Faults of a step: the failed state, and steps that are all or nothing.

A step first makes every wait that may fail or be interrupted without a change; from its
first change on it runs to the end. :class:`StepGuard` holds the failure (after which every
step, save and synchronize refuses, until a load replaces the state) and the interrupts held
back while a step finishes (the pipeline's waits append to them instead of raising).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable


class OptimizerFailedError(RuntimeError):
    """An earlier step or host job failed, so the state may be partly updated: every later
    step(), state_dict() and synchronize() raises this (the original error is its
    ``__cause__``) until load_state_dict() of a good checkpoint."""


class StepGuard:
    def __init__(self, pipeline) -> None:
        self._pipeline = pipeline
        self.failure: BaseException | None = None
        self.failed_at = 0
        self.deferred: BaseException | None = None
        """Data parallelism: a failure this rank keeps until the ranks agree at an apply."""

    def fail(self, error: BaseException, step: int) -> None:
        if self.failure is None:
            self.failure, self.failed_at = error, step

    def clear(self) -> None:
        self.failure = self.deferred = None

    def check(self) -> None:
        """OptimizerFailedError, chained to the failure, once there was one."""
        if self.failure is not None:
            raise OptimizerFailedError(
                f"this ZenFlowOptimizer failed at step {self.failed_at} "
                f"({type(self.failure).__name__}: {self.failure}); its state may be partly "
                "updated, so it refuses to go on or to save: load_state_dict() a good "
                "checkpoint to continue") from self.failure

    def or_fail(self, wait: Callable[[], Any], step: int) -> Any:
        """``wait()`` outside a step (synchronize, eval, state_dict): anything but an
        interrupt raising there leaves the optimizer failed."""
        try:
            return wait()
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            self.fail(e, step)
            raise

    def before(self, waits: Callable[[], None], sharded: bool, step: int) -> None:
        """The waits of a step before its first change: an interrupt leaves the optimizer
        before the step; a failure fails it (under data parallelism it is kept until the
        ranks agree at the next apply, so that every rank hears of it)."""
        try:
            waits()
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            if not sharded:
                self.fail(e, step)
                raise
            self.deferred = self.deferred or e

    @contextlib.contextmanager
    def whole_step(self, step: Callable[[], int]):
        """The changing part of a step: runs to its end. A KeyboardInterrupt (Ctrl-C, or
        one raised inside a wait for host work) is held back and raised after it; any other
        exception leaves the optimizer failed."""
        held: list[BaseException] = []
        restore = _hold_sigint(held)
        self._pipeline.shield = held
        try:
            yield
        except BaseException as e:
            self.fail(e, step())
            raise
        finally:
            self._pipeline.shield = None
            restore()
        if held:  # an interrupt held back: raised now, or the user's handler run now
            first = held[0]
            if isinstance(first, BaseException):
                raise first
            first()


class _SigintGate:
    """SIGINT's handler while an optimizer lives: installed once (again only if someone puts
    another handler in its place), it forwards every signal to the handler it took the
    place of, except while a step holds them (``holding``): then it notes the signal, and
    the step delivers it when it is done. No handler is swapped per step. The signal
    arrives on the main thread only, where the steps that hold it run."""

    def __init__(self) -> None:
        self.original: Any = None
        self.holding = False
        self.caught: list = []

    def __call__(self, signum, frame) -> None:
        if self.holding:
            self.caught.append((signum, frame))
            return
        self.original(signum, frame)


_GATE = _SigintGate()


def _hold_sigint(held: list):
    """Until the returned function is called, SIGINT (Ctrl-C) runs nothing where the main
    thread is: it is noted in ``held``, and the returned function delivers it to the
    handler in place before the step, once (Python's own raises KeyboardInterrupt; a
    user's, such as a "graceful stop" that raises KeyboardInterrupt or sets a flag, runs as
    it would have, only after the step). Only on the main thread with a Python-level
    handler in place (not SIG_IGN or SIG_DFL); elsewhere nothing changes. The gate
    (:class:`_SigintGate`) is installed at the first step and stays: a step only sets and
    clears its flag."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    try:
        handler = signal.getsignal(signal.SIGINT)
        if handler is not _GATE:
            if not callable(handler):
                return lambda: None
            _GATE.original = handler  # the gate forwards to it whenever no step holds
            signal.signal(signal.SIGINT, _GATE)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        return lambda: None
    if _GATE.holding:  # a step inside a step (finish() from a callback): the outer delivers
        return lambda: None
    _GATE.holding, _GATE.caught = True, []
    original = _GATE.original

    def restore() -> None:
        _GATE.holding = False
        caught, _GATE.caught = _GATE.caught, []
        if caught and not held:  # raised by the handler after the step (whole_step's finally)
            held.append(lambda: original(*caught[0]))
    return restore


def release_sigint() -> None:
    """Put SIGINT's handler back as it was before the gate, if the gate is in place and no
    step holds it (the last optimizer closing; a leftover gate would only forward)."""
    if threading.current_thread() is not threading.main_thread() or _GATE.holding:
        return
    try:
        if signal.getsignal(signal.SIGINT) is _GATE and _GATE.original is not None:
            signal.signal(signal.SIGINT, _GATE.original)
    except (ValueError, OSError):
        pass
