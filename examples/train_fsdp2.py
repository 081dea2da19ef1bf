"""Training with ZenFlowOptimizer under FSDP2 (``fully_shard``): each rank holds, and
optimizes, only its rows of every param.

    torchrun --standalone --nproc_per_node 2 examples/train_fsdp2.py --steps 40

CPU (gloo) or GPUs (NCCL, one per rank). The tiny byte-level decoder LM of ``zenflow-tune``
trains on Python's own ``pydoc_data`` text, wrapped with ``fully_shard``: every param
becomes a DTensor sharded by rows, and ZenFlowOptimizer works on each rank's rows (device
half, host half, moments), summing the column scores over the ranks so that every rank
selects the same columns. Gradients are clipped by their global norm
(``clip_grad_norm_`` sees every shard), and with ``--save DIR`` model and optimizer are
saved through ``torch.distributed.checkpoint`` (each rank writes its rows).

Rank 0 prints the loss and every rank's optimizer memory; at the end the script checks that
every rank made the same selections (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.workload import tiny_lm  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--save", default=None, help="a DCP checkpoint directory to write at the end")
    args = ap.parse_args(argv)

    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    wl = tiny_lm(seed=0, device=device, batch_size=8 * world)
    model = fully_shard(wl.model)  # every param a DTensor sharded by rows (Shard(0))
    opt = ZenFlowOptimizer(model.parameters(), lr=args.lr, topk_ratio=args.topk_ratio,
                           update_interval=args.update_interval, min_offload_numel=1024)
    for step in range(1, args.steps + 1):
        x, y = next(wl.batches)  # the same batch on every rank: each takes its share
        n = x.shape[0] // world
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=True)
        loss = wl.loss_fn(model, (xs, ys))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    opt.synchronize()  # collective: every rank applies its pending host results
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=args.save)
    st = opt.stats()
    mine = torch.tensor([st["host_state_bytes"], st["device_state_bytes"],
                         st["collective_bytes"]], dtype=torch.float64)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    picks = torch.cat([s["device_idx"].double() for s in opt.state.values()
                       if "device_idx" in s]).cpu()
    sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, torch.stack([picks.sum(), (picks * picks.cumsum(0)).sum()]))
    same = all(torch.equal(s, sums[0]) for s in sums)
    if rank == 0:
        for r, b in enumerate(every):
            print(f"rank {r}: host state {b[0].item() / 2**20:.2f} MiB, "
                  f"device state {b[1].item() / 2**20:.2f} MiB, "
                  f"optimizer collectives {b[2].item() / args.steps:.0f} B/step "
                  f"({b[2].item() / args.steps / model_bytes:.2e} of the model's "
                  f"{model_bytes / 2**20:.2f} MiB)")
        print(f"world {world}: the same selections on every rank: {same}")
    opt.close()
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
