"""A training script for the teardown tests (tests/test_teardown.py): trains a small model with
ZenFlowOptimizer for a few steps (a host job in flight at the end), then ends as ``--end``
says. Under torchrun (``--ddp``) the model is wrapped in DDP over gloo.

Ends: ``close`` (close(), then exit), ``none`` (no close(): the interpreter's exit),
``raise`` (an exception out of the loop), ``sys-exit-in-handler`` (SIGINT handled by a
handler that calls sys.exit(3), the signal sent mid-run), ``interrupt-at-exit`` (a
KeyboardInterrupt raised after the loop, while a host job is in flight),
``close-then-destroy`` and ``destroy-then-close`` (under torchrun with ``--ddp``: the two
orders of close() and destroy_process_group()).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

from zenflow_triton import ZenFlowOptimizer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--end", required=True)
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    dist = None
    if a.ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4,
                           min_offload_numel=1024)
    if a.end == "sys-exit-in-handler":
        signal.signal(signal.SIGINT, lambda *_: sys.exit(3))
    for step in range(a.steps):
        x = torch.randn(8, 64)
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        if a.end == "sys-exit-in-handler" and step == a.steps // 2:
            os.kill(os.getpid(), signal.SIGINT)  # delivered between bytecodes, in the loop
        if a.end == "raise" and step == a.steps - 2:
            raise RuntimeError("a bug in the training loop")
    print("trained", flush=True)
    if a.end == "interrupt-at-exit":
        raise KeyboardInterrupt
    if a.end == "close":
        opt.close()
    elif a.end == "close-then-destroy":
        opt.close()
        dist.destroy_process_group()
    elif a.end == "destroy-then-close":
        dist.destroy_process_group()
        opt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
