"""Screening the "per-step second moment" remedy of issue 42, bench-only (no library change).

The host's ``v`` is an EMA of squared window means, whose noise variance is ``sigma^2 / n``
where AdamW's per-step ``v`` sees ``sigma^2``: a host step normalises a noisy coordinate by
about ``sigma / sqrt(n)`` and a steady one by ``|mu|``, so no per-param multiplier matches
AdamW on both (``c = sqrt(n)`` matches the noisy ones, ``c = n`` the steady ones). Fed the
mean of the window's per-step squares instead, ``v`` estimates ``mu^2 + sigma^2`` as AdamW's
does, and one host step at ``c = n`` drifts ``n * lr * mu / sqrt(mu^2 + sigma^2)`` (AdamW's
``n`` steps) with a diffusion of ``sqrt(n) * lr`` (theirs too).

How, without touching the library: every ``step()`` adds ``g^2`` of each split matrix
(post-clipping, the gradient the optimizer sees) into a script-side sum; when a window
closes (``zenflow_triton.optimizer.close_windows``, wrapped here) and before its host job
runs, the host ``v`` of the window's host-owned columns gets

    v += (1 - beta2) / beta2 * (S / n - (A / n)^2)        (S: sum of g^2, A: the window sum)

so that the fused AdamW's ``v <- beta2 v + (1 - beta2) (A / n)^2`` leaves exactly
``beta2 v + (1 - beta2) S / n`` (the added term is a variance, never negative); ``m`` still
gets the window mean. The window's lr is ``lr * min(n, cap)`` (``--cap trust``: the trust cap
of ``host.step_size.cap_of_sums``; ``--cap none``: ``n``): the config runs with
``host_lr_scale="auto"`` (``lr * n``) and the wrapper rescales. Every other field is the
setting's (default: the library's defaults).

The runs are ``train.run`` (``study.py``'s recipe and evaluations), so the rows compare with
the study's; ``--adamw`` names study JSONs whose AdamW rows (same workload and seed) the
table subtracts.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python bench/convergence/sumsq.py --seeds 0 1 \\
        --adamw bench/convergence/data/convergence.json \\
        --json bench/convergence/data/sumsq_tweets.json

A library version would hold ``S`` next to the window accumulator (``acc``): one more
``[rows, cols - k]`` buffer on the accumulating side, added into every step
(``g[:, host_idx]^2``), and the host job would take ``S / n`` into ``v``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from study import WORKLOADS  # noqa: E402
from workloads import BUILDERS  # noqa: E402

import zenflow_triton.optimizer as ZO  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402
from zenflow_triton.host import step_size as SS  # noqa: E402
from zenflow_triton.state import MATRIX, classify  # noqa: E402

_ORIGINAL_CLOSE = ZO.close_windows
_ACTIVE: dict = {}  # the one optimizer of this process being patched: its sums and options


def _closing(param_groups, state, config, shard, direct, apply_now, warmup):
    """``close_windows`` and then, for each window of more than one gradient, the per-step
    second moment put into ``v`` and the lr set to ``lr * min(n, cap)``."""
    windows = _ORIGINAL_CLOSE(param_groups, state, config, shard, direct, apply_now, warmup)
    act = _ACTIVE
    if not act:
        return windows
    for w in windows:
        sums = act["sums"].get(w.key)
        n = int(w.hyper.grad_divisor)
        if sums is None:
            continue
        st = state[w.key]
        if n > 1 and w.source != "direct":
            assert w.v.dtype == torch.float32 and not act["opt"]._pipeline.inflight
            b2 = w.hyper.beta2
            s_mean = sums[:, st["host_idx"]] / n
            g_mean = st["acc"].float() / n
            w.v.add_((s_mean - g_mean * g_mean).clamp_min_(0), alpha=(1 - b2) / b2)
            base = w.hyper.lr / SS.fixed_multiplier("auto", n)
            c = float(n)
            if act["cap"] == "trust":
                c = min(c, SS.cap_of_sums(SS.sample_sums(w.master, w.m, w.v), base))
            w.hyper = dataclasses.replace(w.hyper, lr=base * c)
            act["multipliers"].append(c)
        sums.zero_()
    return windows


def install(opt: ZenFlowOptimizer, named, cap: str) -> None:
    """Patch ``opt`` (the only one in this process): the per-step sums of g^2 of its split
    matrices, taken before every ``step()``, and the window closing above."""
    mats = [p for n, p in named if classify(p, opt.config, n) == MATRIX]
    sums: dict = {}
    _ACTIVE.clear()
    _ACTIVE.update(opt=opt, sums=sums, cap=cap, multipliers=[])
    ZO.close_windows = _closing
    step = opt.step

    def stepping(self, closure=None):
        for p in mats:
            if p.grad is None:
                continue
            g = p.grad.detach().reshape(p.shape[0], -1).float()
            s = sums.get(p)
            if s is None:
                s = sums[p] = torch.zeros_like(g)
            s.addcmul_(g, g)
        return step(closure)

    opt.step = types.MethodType(stepping, opt)  # bound: LambdaLR wraps it in turn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="minilm-tweets", choices=list(WORKLOADS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--topk-ratio", type=float, default=None)
    ap.add_argument("--update-interval", type=int, default=None)
    ap.add_argument("--cap", choices=("trust", "none"), default="trust")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other config field (e.g. overlap=false); named in the row")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adamw", nargs="*", default=[],
                    help="study JSONs whose AdamW rows the table subtracts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lr, steps, every, options, *more = WORKLOADS[args.workload]
    steps = args.steps or steps
    setting = dict(host_lr_scale="auto")
    if args.topk_ratio is not None:
        setting["topk_ratio"] = args.topk_ratio
    if args.update_interval is not None:
        setting["update_interval"] = args.update_interval
    for kv in args.set:
        key, _, val = kv.partition("=")
        try:
            setting[key] = json.loads(val)
        except json.JSONDecodeError:
            setting[key] = val
    name = (f"sumsq-{args.cap}cap" + (f"-{args.topk_ratio}x{args.update_interval}"
                                      if args.topk_ratio or args.update_interval else "")
            + "".join(f"-{kv}" for kv in args.set))
    made = train.make_optimizer
    record: dict = {}

    def make(params, lr_, zenflow):
        opt = made(params, lr_, zenflow)
        if isinstance(opt, ZenFlowOptimizer):
            install(opt, params, args.cap)
            record["multipliers"] = _ACTIVE["multipliers"]
        return opt

    train.make_optimizer = make
    rows = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            rows = json.load(f)
    done = {(r["workload"], r["optimizer"], r["seed"], r.get("steps")) for r in rows}
    for seed in args.seeds:
        if (args.workload, name, seed, steps) in done:
            continue
        out = train.run(BUILDERS[args.workload](seed, **options), zenflow=setting, lr=lr,
                        steps=steps, eval_every=every, verbose=True,
                        **(more[0] if more else {}))
        ms = record.get("multipliers") or [float("nan")]
        r = dict(workload=args.workload, optimizer=name, seed=seed, config=setting,
                 cap=args.cap, multiplier_mean=statistics.mean(ms),
                 multiplier_min=min(ms), multiplier_max=max(ms),
                 command=" ".join(sys.argv), **out)
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("workload", "optimizer", "seed", "final",
                                            "seconds", "multiplier_mean")}),
              file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    ref = {}
    for path in args.adamw:
        if os.path.exists(path):
            with open(path) as f:
                for r in json.load(f):
                    if r["optimizer"] == "adamw" and r["workload"] == args.workload:
                        ref[r["seed"]] = r["final"]
    print("| workload | optimizer | seed | held-out loss | minus AdamW | accuracy | minus AdamW "
          "| c mean (min-max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f, a = r["final"], ref.get(r["seed"])
        dl = f"{f['loss'] - a['loss']:+.4f}" if a else "-"
        da = f"{100 * (f['accuracy'] - a['accuracy']):+.1f} pts" if a else "-"
        print(f"| {r['workload']} | {r['optimizer']} | {r['seed']} | {f['loss']:.4f} | {dl} "
              f"| {100 * f.get('accuracy', float('nan')):.1f}% | {da} "
              f"| {r['multiplier_mean']:.2f} ({r['multiplier_min']:.2f}-"
              f"{r['multiplier_max']:.2f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
