"""The one way this library waits: poll until done, bounded by a timeout (and, where given,
by a liveness check), so that no wait can hang."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(done: Callable[[float], bool], timeout: float,
               timed_out: Callable[[], BaseException], *, poll_s: float,
               check: Callable[[], None] | None = None) -> None:
    """Call ``done(poll_s)`` (which may block up to ``poll_s`` seconds, or raise) until it
    returns True; between calls ``check()`` may raise (a dead thread), and past ``timeout``
    seconds ``timed_out()`` is raised."""
    deadline = time.monotonic() + timeout
    while not done(poll_s):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise timed_out()
