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
AdamW's of the same seeds; ``DIV`` marks a divergence) and the rule chosen among the rules
that never diverge on the grid: with ``--convergence F`` (the JSON of ``study.py``), the
one with the best mean gap to AdamW on the pretrained models there (SmolLM2, MiniLM: the
defaults with each rule, ``CONVERGENCE_RULES``), which is what the quality goal is about;
without it, the best mean over the grid. The grid's small models at lr 1e-3 sit near the
edge of stability, where any longer stale step costs; they judge safety, not fine-tuning
quality.

    python bench/convergence/lr_scale.py --report lr_scale.json \
        --convergence bench/convergence/data/convergence.json
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

from zenflow_triton.config import ZenFlowConfig  # noqa: E402
from zenflow_triton.host.step_size import SQRT_SCALE_CAP  # noqa: E402

# "sqrt-cap" is the shipped "sqrt" rule: sqrt(n), at most SQRT_SCALE_CAP. "sqrt" is uncapped.
RULES = ("1", "sqrt", "sqrt-cap", "n", "adaptive", "adaptive-window", "adaptive-window-delay1")
# "adaptive-window": the adaptive rule with host_betas="window" (the host moments decayed by
# beta ** n per window of n gradients); "-delay1": and each result applied the step after
# its window (apply_delay=1)
WINDOW_BETAS = {"adaptive-window", "adaptive-window-delay1"}
INTERVALS = (2, 4, 8, 16)
DEFAULTS = {  # workload: (lr, steps, builder options)
    "minilm": (5e-5, 160, dict(seq_len=64, batch_size=8)),  # short articles: cheap steps
    "tinylm-ft": (1e-3, 320, {}),
    "tinylm": (1e-3, 320, {}),
}


def scale_for(rule: str, interval: int):
    return {"1": 1.0, "sqrt": math.sqrt(interval),
            "sqrt-cap": min(math.sqrt(interval), SQRT_SCALE_CAP), "n": "auto",
            "adaptive": "adaptive", "adaptive-window": "adaptive",
            "adaptive-window-delay1": "adaptive"}[rule]


# study.py's optimizer that runs the shipped defaults (update_interval=4) with each rule.
# At interval 4 "sqrt" and "sqrt-cap" are the same multiplier (2), so the same runs.
CONVERGENCE_RULES = {"1": "zenflow-scale-1", "sqrt": "zenflow", "sqrt-cap": "zenflow",
                     "n": "zenflow-scale-n", "adaptive": "zenflow-adaptive",
                     "adaptive-window": "zenflow-adaptive-dense-window",
                     "adaptive-window-delay1": "zenflow-adaptive-dense-window-delay1"}


def real_model_gaps(conv_rows: list[dict]) -> dict[str, list[float]]:
    """Per rule, the final held-out loss minus AdamW's (same workload and seed) of every
    convergence-study run of the defaults with that rule."""
    ref = {(r["workload"], r["seed"]): r["final"]["loss"] for r in conv_rows
           if r["optimizer"] == "adamw"}
    gaps: dict[str, list[float]] = {rule: [] for rule in RULES}
    for rule, name in CONVERGENCE_RULES.items():
        for r in conv_rows:
            k = (r["workload"], r["seed"])
            if r["optimizer"] == name and k in ref:
                gaps[rule].append(r["final"]["loss"] - ref[k])
    return gaps


def run_rule(rule: str, interval: int) -> str:
    """The rule whose runs stand for ``rule`` at ``interval``: a capped cell below the cap is
    the uncapped run (the same multiplier), not a second run of it."""
    if rule == "sqrt-cap" and scale_for("sqrt", interval) <= SQRT_SCALE_CAP:
        return "sqrt"
    return rule


def key(r: dict) -> tuple:
    return (r["workload"], r["optimizer"], r.get("rule"), r.get("interval"), r.get("topk"),
            r["seed"])


def plan(workloads, topks, seeds, rules=RULES):
    for wl in workloads:
        for seed in seeds:
            yield dict(workload=wl, optimizer="adamw", rule=None, interval=None, topk=None,
                       seed=seed)
            for topk in topks:
                for interval in INTERVALS:
                    for rule in dict.fromkeys(run_rule(r, interval) for r in rules):
                        yield dict(workload=wl, optimizer="zenflow", rule=rule,
                                   interval=interval, topk=topk, seed=seed)


def execute(cell: dict, steps: int, lr: float, options: dict) -> dict:
    job = BUILDERS[cell["workload"]](cell["seed"], **options)
    zf = None
    if cell["optimizer"] == "zenflow":
        zf = dict(topk_ratio=cell["topk"], update_interval=cell["interval"],
                  host_lr_scale=scale_for(cell["rule"], cell["interval"]))
        if cell["rule"] in WINDOW_BETAS:
            zf["host_betas"] = "window"
        if cell["rule"].endswith("-delay1") and cell["interval"] > 1:
            zf["apply_delay"] = 1
    out = run(job, zenflow=zf, lr=lr, steps=steps, eval_every=steps)
    # the dense set in force (train.run names the params): a file's runs say which they had
    dense = list(ZenFlowConfig().dense_params) if zf else None
    return dict(cell, steps=steps, lr=lr, dense_params=dense, init=out["init"]["loss"],
                final=out["final"]["loss"], accuracy=out["final"].get("accuracy"),
                diverged=out["diverged"], seconds=round(out["seconds"], 2),
                host_windows=out.get("host_windows"))


def report(rows: list[dict], conv_rows: list[dict] | None = None) -> tuple[str, str | None]:
    lines = []
    by_wl: dict[str, list[dict]] = {}
    for r in rows:
        by_wl.setdefault(r["workload"], []).append(r)
    rule_div = {rule: 0 for rule in RULES}
    # the rules this file has runs of (a file of chosen --rules reports those only)
    present = {r.get("rule") for r in rows if r["optimizer"] == "zenflow"}
    rules = [rule for rule in RULES if any(run_rule(rule, k) in present for k in INTERVALS)]
    rule_missing = {rule: 0 for rule in RULES}  # grid cells without runs
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
            for rule in rules:
                cells = []
                for k in INTERVALS:
                    mine = [r for r in rs if r.get("rule") == run_rule(rule, k)
                            and r.get("interval") == k and r.get("topk") == topk]
                    if not mine:
                        rule_missing[rule] += 1
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
    real = real_model_gaps(conv_rows) if conv_rows is not None else None
    mean = lambda xs: statistics.mean(xs) if xs else float("nan")  # noqa: E731
    if real is None:
        lines.append("\n| rule | divergences | mean gap to AdamW over the grid (nats) |")
        lines.append("| --- | --- | --- |")
    else:
        lines.append("\n| rule | divergences | mean gap to AdamW over the grid (nats) | "
                     "mean gap on the pretrained models (nats, runs) |")
        lines.append("| --- | --- | --- | --- |")
    for rule in rules:
        div = f"{rule_div[rule]}" + (f" ({rule_missing[rule]} cells not run)"
                                     if rule_missing[rule] else "")
        row = f"| {rule} | {div} | {mean(rule_gap[rule]):+.4f} |"
        if real is not None:
            row += f" {mean(real[rule]):+.4f} ({len(real[rule])}) |"
        lines.append(row)
    # safe: never diverged, with runs in every cell of the grid
    safe = [r for r in rules if rule_div[r] == 0 and rule_gap[r] and not rule_missing[r]]
    if real is not None:
        judged = [r for r in safe if real[r]]
        chosen = min(judged, key=lambda r: (mean(real[r]), RULES.index(r))) if judged else None
        what = "the best rule on the pretrained models among those that never diverge"
    else:
        chosen = min(safe, key=lambda r: mean(rule_gap[r])) if safe else None
        what = "the best rule that never diverges"
    if chosen:
        lines.append(f"\nChosen: {what}: **{chosen}**.")
    elif not safe:
        lines.append("\nEvery rule diverged somewhere: none is safe on this grid.")
    else:
        lines.append("\nNo safe rule has runs on the pretrained models: none chosen.")
    return "\n".join(lines), chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(DEFAULTS), choices=list(DEFAULTS))
    ap.add_argument("--topk", type=float, nargs="+", default=[0.01, 0.1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES),
                    help="the rules to run (AdamW runs for every workload and seed)")
    ap.add_argument("--steps", type=int, default=None, help="override every workload's steps")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's); 1 lets two studies share 2 cores")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print the tables of a --json file")
    ap.add_argument("--convergence", default=None,
                    help="study.py's JSON: choose among the safe rules by the pretrained models")
    args = ap.parse_args(argv)
    conv = None
    if args.convergence:
        with open(args.convergence) as f:
            conv = json.load(f)
    if args.report:
        with open(args.report) as f:
            print(report(json.load(f), conv)[0])
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    done = {key(r) for r in rows}
    t0 = time.perf_counter()
    for cell in plan(args.workloads, args.topk, args.seeds, args.rules):
        if key(cell) in done:
            continue
        lr, steps, options = DEFAULTS[cell["workload"]]
        r = execute(cell, args.steps or steps, lr, options)
        rows.append(r)
        print(json.dumps(r), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(report(rows, conv)[0])
    print(f"\nwall time of this invocation: {time.perf_counter() - t0:.0f} s; "
          f"torch threads {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
