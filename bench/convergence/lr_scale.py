"""Which host step-size rule is safe at every update interval? (``host_lr_scale``)

A host-owned column gets one Adam step per window of ``n`` gradients. The rules compared:
``1`` (one ordinary step per window: ZenFlow's and DeepSpeed's semantics), ``sqrt`` (``√n``
times the lr) and ``n`` (``n`` times the lr: as far per step as AdamW would travel). Each
workload is fine-tuned (or trained from scratch) with each rule at ``update_interval`` 2, 4,
8 and 16, each ``topk_ratio`` given, seeds 0 and 1, plus ``torch.optim.AdamW`` per seed,
with the recipe of ``train.py`` (warm-up, clipping). A run **diverges** when its final
held-out loss is not finite or is above the loss before training.

    HF_HUB_OFFLINE=1 python bench/convergence/lr_scale.py --json lr_scale.json
    python bench/convergence/lr_scale.py --report lr_scale.json   # the tables again

Rows already in ``--json`` are kept and not rerun (a stopped study resumes). Output: one
markdown table per workload and topk_ratio (mean final held-out loss over seeds, minus
AdamW's of the same seeds; ``DIV`` marks a divergence) and the rule chosen: the best mean
loss over the whole grid among the rules that never diverge.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import run  # noqa: E402
from workloads import BUILDERS  # noqa: E402

RULES = ("1", "sqrt", "n")
INTERVALS = (2, 4, 8, 16)
DEFAULTS = {  # workload: (lr, steps, builder options)
    "minilm": (5e-5, 160, dict(seq_len=64, batch_size=8)),  # short articles: cheap steps
    "tinylm-ft": (1e-3, 320, {}),
    "tinylm": (1e-3, 320, {}),
}


def scale_for(rule: str, interval: int):
    return {"1": 1.0, "sqrt": math.sqrt(interval), "n": "auto"}[rule]


def key(r: dict) -> tuple:
    return (r["workload"], r["optimizer"], r.get("rule"), r.get("interval"), r.get("topk"),
            r["seed"])


def plan(workloads, topks, seeds):
    for wl in workloads:
        for seed in seeds:
            yield dict(workload=wl, optimizer="adamw", rule=None, interval=None, topk=None,
                       seed=seed)
            for topk in topks:
                for interval in INTERVALS:
                    for rule in RULES:
                        yield dict(workload=wl, optimizer="zenflow", rule=rule,
                                   interval=interval, topk=topk, seed=seed)


def execute(cell: dict, steps: int, lr: float, options: dict) -> dict:
    job = BUILDERS[cell["workload"]](cell["seed"], **options)
    zf = None
    if cell["optimizer"] == "zenflow":
        zf = dict(topk_ratio=cell["topk"], update_interval=cell["interval"],
                  host_lr_scale=scale_for(cell["rule"], cell["interval"]))
    out = run(job, zenflow=zf, lr=lr, steps=steps, eval_every=steps)
    return dict(cell, steps=steps, lr=lr, init=out["init"]["loss"],
                final=out["final"]["loss"], accuracy=out["final"].get("accuracy"),
                diverged=out["diverged"], seconds=round(out["seconds"], 2),
                host_windows=out.get("host_windows"))


def report(rows: list[dict]) -> tuple[str, str | None]:
    lines = []
    by_wl: dict[str, list[dict]] = {}
    for r in rows:
        by_wl.setdefault(r["workload"], []).append(r)
    rule_div = {rule: 0 for rule in RULES}
    rule_gap: dict[str, list[float]] = {rule: [] for rule in RULES}
    for wl, rs in by_wl.items():
        ref = {r["seed"]: r["final"] for r in rs if r["optimizer"] == "adamw"}
        init = statistics.mean(r["init"] for r in rs)
        topks = sorted({r["topk"] for r in rs if r["optimizer"] == "zenflow"})
        lr = rs[0]["lr"]
        steps = rs[0]["steps"]
        for topk in topks:
            lines += [f"\n**{wl}**, topk_ratio={topk}, lr={lr:g}, {steps} steps; held-out "
                      f"loss before training {init:.4f}, AdamW "
                      f"{statistics.mean(ref.values()) if ref else float('nan'):.4f} "
                      f"(mean of seeds {sorted(ref)}). Cells: mean final held-out loss minus "
                      "AdamW's (same seeds); DIV = a seed diverged.\n",
                      "| rule | " + " | ".join(f"interval {k}" for k in INTERVALS) + " |",
                      "| --- |" + " --- |" * len(INTERVALS)]
            for rule in RULES:
                cells = []
                for k in INTERVALS:
                    mine = [r for r in rs if r.get("rule") == rule and r.get("interval") == k
                            and r.get("topk") == topk]
                    if not mine:
                        cells.append("")
                        continue
                    div = sum(bool(r["diverged"]) for r in mine)
                    rule_div[rule] += div
                    gaps = [r["final"] - ref[r["seed"]] for r in mine if r["seed"] in ref]
                    if gaps and all(math.isfinite(g) for g in gaps):
                        rule_gap[rule] += gaps
                        g = f"{statistics.mean(gaps):+.4f}"
                    else:
                        g = "nan"
                        rule_gap[rule].append(math.inf)
                    cells.append(g + (f" DIV({div})" if div else ""))
                lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    lines.append("\n| rule | divergences | mean gap to AdamW over the grid (nats) |")
    lines.append("| --- | --- | --- |")
    for rule in RULES:
        gap = statistics.mean(rule_gap[rule]) if rule_gap[rule] else float("nan")
        lines.append(f"| {rule} | {rule_div[rule]} | {gap:+.4f} |")
    safe = [r for r in RULES if rule_div[r] == 0 and rule_gap[r]]
    chosen = min(safe, key=lambda r: statistics.mean(rule_gap[r])) if safe else None
    lines.append(f"\nChosen: the best rule that never diverges: **{chosen}**." if chosen
                 else "\nEvery rule diverged somewhere: none is safe on this grid.")
    return "\n".join(lines), chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--topk", type=float, nargs="+", default=[0.01, 0.1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="override every workload's steps")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 lets two studies share 2 cores")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print the tables of a --json file")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f))[0])
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    done = {key(r) for r in rows}
    t0 = time.perf_counter()
    for cell in plan(args.workloads, args.topk, args.seeds):
        if key(cell) in done:
            continue
        lr, steps, options = DEFAULTS[cell["workload"]]
        r = execute(cell, args.steps or steps, lr, options)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(report(rows)[0])
    print(f"\nwall time of this invocation: {time.perf_counter() - t0:.0f} s; "
          f"torch threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
