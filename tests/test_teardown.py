"""How a training script ends, in the orders users write (issue 49): each ends with its own
exit code, in bounded time, without a signal-killed process or a hang.

Each case runs tests/support/teardown.py in a fresh interpreter (the exit path is the thing
under test), with a host job in flight at the end; a hang fails by the subprocess timeout."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from .support.helpers import tree_env
from .test_distributed import torchrun

TIMEOUT = 120


@pytest.mark.parametrize("end,code,says", [
    ("close", 0, "trained"),
    ("none", 0, "trained"),                               # no close(): atexit stops the threads
    ("raise", 1, "a bug in the training loop"),           # the traceback, exit 1
    ("sys-exit-in-handler", 3, ""),                       # the user's handler's exit code
    ("interrupt-at-exit", 128 + signal.SIGINT, "KeyboardInterrupt"),  # Python's own code
])
def test_a_single_process_ends_with_its_own_exit_code(end, code, says):
    proc = subprocess.run([sys.executable, "-m", "tests.support.teardown", "--end", end],
                          cwd=tree_env()["PYTHONPATH"].split(":")[0], env=tree_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    want = code if end != "interrupt-at-exit" else (code, -signal.SIGINT)
    assert proc.returncode in (want if isinstance(want, tuple) else (want,)), out[-2000:]
    assert says in out, out[-2000:]
    assert "Fatal Python error" not in out and "terminate called" not in out, out[-2000:]


@pytest.mark.parametrize("end", ["close-then-destroy", "destroy-then-close"])
def test_ddp_ranks_end_cleanly_whichever_comes_first(end):
    out = torchrun(["-m", "tests.support.teardown", "--ddp", "--end", end], timeout=TIMEOUT)
    assert out.count("trained") == 2 and "Fatal Python error" not in out, out[-2000:]
