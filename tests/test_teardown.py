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


def test_close_after_the_process_group_is_gone_warns_and_stops(monkeypatch):
    # DDP, destroy_process_group() before close(): no collective can finish the open window
    # any more; close() says so and stops the host threads instead of failing (the 2-rank
    # runs of both orders: the test below)
    import torch

    from zenflow_triton import ZenFlowOptimizer
    from zenflow_triton.dist.shard import RowShard

    model = torch.nn.Sequential(torch.nn.Linear(64, 128))
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, update_interval=4,
                           min_offload_numel=1024)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    monkeypatch.setattr(RowShard, "gone", property(lambda self: True))
    with pytest.warns(UserWarning, match="after destroy_process_group"):
        opt.close()
    assert opt._closed and not opt._worker.alive
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # unapplied


@pytest.mark.parametrize("end", ["close-then-destroy", "destroy-then-close"])
def test_ddp_ranks_end_cleanly_whichever_comes_first(end):
    from .test_distributed import torchrun

    out = torchrun(["-m", "tests.support.teardown", "--ddp", "--end", end], timeout=TIMEOUT)
    assert out.count("trained") == 2, out[-2000:]
    assert "Fatal Python error" not in out and "terminate called" not in out, out[-2000:]
    if end == "destroy-then-close":
        assert "after destroy_process_group()" in out  # said, not raised
