"""Run by tests/test_frameworks.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): the HF
Trainer with a ZenFlowOptimizer under DDP, saving a checkpoint every 4 steps. The Trainer
calls ``optimizer.state_dict()`` on rank 0 only; with ``ZenFlowCallback`` every rank gathers
first, so the save neither hangs nor deadlocks the next step's collectives.

Usage: hf_ddp_save.py OUT_DIR [--no-callback]. Rank 0 writes OUT_DIR/result.pt: the saved
optimizer state's host-half row counts, and the final params of every rank (from rank 0's
view of an all-gather), to check that the run went on after the saves.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import transformers

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.hf import ZenFlowCallback

V, SEQ = 64, 12


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = (torch.randint(0, V, (n, 1), generator=g) + torch.arange(SEQ)) % V

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> tuple:
    out = sys.argv[1]
    callbacks = [] if "--no-callback" in sys.argv else [ZenFlowCallback()]
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=8, per_device_train_batch_size=4, report_to=[],
        use_cpu=True, save_strategy="steps", save_steps=4, logging_steps=1,
        disable_tqdm=True, seed=0, dataloader_num_workers=0, ddp_backend="gloo")
    opt = ZenFlowOptimizer(list(model.named_parameters()), lr=1e-3, topk_ratio=0.25,
                           update_interval=2, min_offload_numel=64, host_threads=1,
                           host_timeout=60)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CountingDataset(64),
                                   optimizers=(opt, sched), callbacks=callbacks)
    trainer.train()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    # held to the end (async, returned to the module): a sync all_gather's work may be
    # released last by gloo's thread, which at exit hangs or aborts (examples/train_ddp.py)
    work = dist.all_gather(every, flat, async_op=True)
    work.wait()
    if dist.get_rank() == 0:
        saved = torch.load(os.path.join(out, "checkpoint-8", "optimizer.pt"), weights_only=False)
        rows = sorted(st["host_master"].shape[0] for st in saved["state"].values()
                      if "host_master" in st)
        torch.save(dict(rows=rows, world=dist.get_world_size(), params=every,
                        steps=opt.stats()["steps"], saved_step=saved["zenflow"]["global_step"]),
                   os.path.join(out, "result.pt"))
    opt.close()
    return work, every, flat


if __name__ == "__main__":
    KEPT = main()
