"""Data-parallel training with ZenFlowOptimizer under DDP: the host work sharded by rows.

    torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps 40

CPU (gloo) or GPUs (NCCL, one per rank), one machine or several (torchrun's usual flags):
nothing here assumes a single node. The tiny byte-level decoder LM of ``zenflow-tune``
trains on Python's own ``pydoc_data`` text; each rank takes its share of every batch, DDP
averages the gradients, and ZenFlowOptimizer(process_group=None) picks up the default group:
every rank makes the same selection and device updates, each keeps and updates only its rows
of the host half, and the ranks gather each other's rows at the apply point.

Rank 0 prints the loss and every rank's host memory; at the end the script checks that every
rank holds the same params (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.training import tiny_lm  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def arguments(doc: str, argv=None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    return ap


def start() -> tuple[int, int, torch.device, object]:
    """torch.distributed up (NCCL on GPUs, else gloo); (rank, world, device, the tiny LM
    workload with a batch of 8 per rank), the same initial weights on every rank."""
    if os.environ.get("ZENFLOW_STACKS_ON_USR1"):  # a stress run's hang: every thread's stack
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    return rank, world, device, tiny_lm(seed=0, device=device, batch_size=8 * world)


def train(model, wl, opt, steps: int, rank: int, world: int, clip: float | None = None):
    for step in range(1, steps + 1):
        x, y = next(wl.batches)  # the same batch on every rank: each takes its share
        n = x.shape[0] // world
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=True)
        loss = wl.loss_fn(model, (xs, ys))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # the global norm
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    opt.finish()  # collective: the end of training, every gradient applied on every rank


KEPT: list = []
"""This script's own collectives (work objects and tensors), held until the process exits.
A synchronous ``dist.all_gather`` drops its work in Python as soon as it is done, and gloo's
thread may then drop it last: releasing its tensors there takes the GIL, and at exit (DDP's
reducer frees the process group, which joins that thread while holding the GIL) that is a
hang (docs/distributed.md, "The end of a run"). Held here, gloo's thread never releases them
last."""


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """``dist.all_gather``, its work and tensors kept in :data:`KEPT`."""
    work = dist.all_gather(outputs, tensor, async_op=True)
    work.wait()
    KEPT.append((work, outputs, tensor))


def same_on_every_rank(values: torch.Tensor, world: int) -> bool:
    """Whether every rank holds the same ``values`` (compared by two float64 sums)."""
    flat = values.reshape(-1).double().cpu()
    sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    all_gather(sums, torch.stack([flat.sum(), (flat * flat.cumsum(0)).sum()]))
    return all(torch.equal(s, sums[0]) for s in sums)


def report_memory(opt, rank: int, world: int, steps: int, model_bytes: int) -> None:
    """Rank 0 prints every rank's optimizer memory and collective bytes per step."""
    st = opt.stats()
    mine = torch.tensor([st["host_state_bytes"], st["device_state_bytes"],
                         st["collective_bytes"]], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    all_gather(every, mine)
    if rank == 0:
        for r, b in enumerate(every):
            print(f"rank {r}: host state {b[0].item() / 2**20:.2f} MiB, "
                  f"device state {b[1].item() / 2**20:.2f} MiB, "
                  f"optimizer collectives {b[2].item() / steps:.0f} B/step "
                  f"({b[2].item() / steps / model_bytes:.2e} of the model's "
                  f"{model_bytes / 2**20:.2f} MiB)")


def main(argv=None) -> int:
    args = arguments(__doc__).parse_args(argv)
    rank, world, device, wl = start()
    model = torch.nn.parallel.DistributedDataParallel(wl.model)
    opt = ZenFlowOptimizer(wl.model.named_parameters(), lr=args.lr, topk_ratio=args.topk_ratio,
                           update_interval=args.update_interval, min_offload_numel=1024)
    train(model, wl, opt, args.steps, rank, world)
    params = list(wl.model.parameters())
    return finish(opt, rank, world, args.steps, params,
                  torch.cat([p.detach().reshape(-1) for p in params]), "params identical")


def finish(opt, rank: int, world: int, steps: int, params, values: torch.Tensor,
           what: str) -> int:
    """Report the memory, check that every rank holds the same ``values`` (``what`` they
    are), close; the exit status (1 if they differ)."""
    report_memory(opt, rank, world, steps, sum(p.numel() * p.element_size() for p in params))
    same = same_on_every_rank(values, world)
    if rank == 0:
        print(f"world {world}: {what} on every rank: {same}")
        # the run's result in one number (bench/stress_teardown.py compares runs by it)
        print(f"checksum {values.double().sum().item():.17g} "
              f"{(values.double() * values.double().cumsum(0)).sum().item():.17g}")
    opt.close()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
