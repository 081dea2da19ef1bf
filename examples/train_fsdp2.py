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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_ddp import arguments, finish, start, train  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def main(argv=None) -> int:
    ap = arguments(__doc__)
    ap.add_argument("--save", default=None, help="a DCP checkpoint directory to write at the end")
    args = ap.parse_args(argv)
    from torch.distributed.fsdp import fully_shard

    rank, world, device, wl = start()
    model = fully_shard(wl.model)  # every param a DTensor sharded by rows (Shard(0))
    opt = ZenFlowOptimizer(model.named_parameters(), lr=args.lr, topk_ratio=args.topk_ratio,
                           update_interval=args.update_interval, min_offload_numel=1024)
    train(model, wl, opt, args.steps, rank, world, clip=1.0)
    if args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=args.save)
    picks = [s["device_idx"] for s in opt.state.values() if "device_idx" in s]
    return finish(opt, rank, world, args.steps, list(model.parameters()), torch.cat(picks),
                  "the same selections")


if __name__ == "__main__":
    sys.exit(main())
