"""Remedies for quality at fast settings, screened on the tuner's own guard.

Each variant trains the tuner's default workload (the tiny LM pretrained on Python code and
fine-tuned on ``pydoc_data``: ``zenflow-tune run``'s objective, 60 steps at lr 3e-4, seed
0 and 1) and is judged as the tuner judges a trial: the held-out loss against AdamW's on the
same data, and the 2% guard (``violation`` <= 0 is feasible). Cheap (about 15 s a variant
on one core), so it screens remedies before the slow runs on real models
(``study.py``).

Variants: a setting (``defaults``: 0.1 x 4, or ``aggressive``: 0.02 x 8, both with
``host_lr_scale="adaptive"``), then any of

* ``split``: ``dense_params=()`` (every matrix split; otherwise the library's dense set:
  the tiny LM's embeddings and LM head whole on the device); ``dense=P1,P2``: that dense
  set instead,
* ``bf16acc``: ``accumulator_dtype="bfloat16"``; ``hostacc``: ``accumulate_on="host"``
  (the lean corner is ``split/bf16acc/hostacc``); ``topkR``: ``topk_ratio=R``,
* ``sqrt``: ``host_lr_scale="sqrt"`` instead of ``"adaptive"``,
* ``selN``: ``select_interval = N x update_interval`` (default 16 windows),
* ``sync``: ``overlap=False`` (each window's result applied at its own boundary),
* ``sign``: an experiment, not a library feature: every step, the host-owned columns of each
  split matrix also take a state-free step ``-lr * c * sign(g)`` on the device (FRUGAL's
  signSGD part), overwritten by the host's fp32 master at the next apply (``sign0.3``:
  c = 0.3; plain ``sign``: c = 1),
* ``applyN``: ``apply_delay=N`` (each window's result applied ``N`` steps after it, instead
  of at the next boundary, ``N = update_interval``, or at its own, ``sync``),
* ``rotate``: an experiment: half of each selection's k columns by score, the other half the
  host-owned columns that have waited longest (against starving columns).

    python bench/convergence/remedies.py --threads 1 \\
        --variants defaults/split defaults aggressive/split aggressive aggressive/sel2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.objective import (TuneSettings, measure_reference, quality_limit,  # noqa: E402
                                train_and_measure)
from autotune.training import load_workload_factory  # noqa: E402
from zenflow_triton import ZenFlowConfig, ZenFlowOptimizer  # noqa: E402
from zenflow_triton import state as P  # noqa: E402
from zenflow_triton.columns import layout as L, selection as S  # noqa: E402

SETTINGS = {"defaults": dict(topk_ratio=0.1, update_interval=4, host_lr_scale="adaptive"),
            "aggressive": dict(topk_ratio=0.02, update_interval=8, host_lr_scale="adaptive")}


def parse(variant: str) -> tuple[dict, float, bool]:
    """``"aggressive/sel2/sign0.3"`` -> (config fields, sign factor, rotate)."""
    base, *mods = variant.split("/")
    cfg = dict(SETTINGS[base])
    sign, rotate = 0.0, False
    for m in mods:
        if m == "split":
            cfg["dense_params"] = ()
        elif m == "bf16acc":
            cfg["accumulator_dtype"] = "bfloat16"
        elif m == "hostacc":
            cfg["accumulate_on"] = "host"
        elif m.startswith("topk"):
            cfg["topk_ratio"] = float(m[4:])
        elif m.startswith("dense="):
            cfg["dense_params"] = tuple(m[6:].split(","))
        elif m == "sqrt":
            cfg["host_lr_scale"] = "sqrt"
        elif m == "sync":
            cfg["overlap"] = False
        elif m.startswith("sel"):
            cfg["select_interval"] = int(m[3:]) * cfg["update_interval"]
        elif m.startswith("sign"):
            sign = float(m[4:] or 1.0)
        elif m == "rotate":
            rotate = True
        elif m.startswith("apply") and m[5:].isdigit():
            cfg["apply_delay"] = int(m[5:])
        else:
            raise ValueError(f"unknown modifier {m!r} in {variant!r}")
    ZenFlowConfig(**cfg)  # a bad value fails here, before any training
    return cfg, sign, rotate


def with_sign_steps(opt: ZenFlowOptimizer, c: float) -> None:
    """The sign experiment: before each step, the host-owned columns of every selected split
    matrix move by -lr * c * sign(g) (fp32 params; the next apply overwrites them with the
    host master, so the host half never sees these steps)."""
    real = opt.step

    def step(closure=None):
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p)
                    if (p.grad is None or not isinstance(st, dict)
                            or st.get("kind") != P.MATRIX or not st.get("selected")):
                        continue
                    cols = st["host_idx"]
                    p2d, g2d = L.view2d(p.detach()), L.view2d(p.grad, like=p)
                    p2d[:, cols] -= group["lr"] * c * torch.sign(g2d[:, cols])
        return real(closure)

    opt.step = step


class Rotating:
    """The rotate experiment's selection: per param, k - k//2 columns by score and k//2 of
    the host-owned columns that have gone longest without a device turn."""

    def __init__(self) -> None:
        self.age: dict[int, np.ndarray] = {}

    def __call__(self, items, state, ops, link, cfg, shard=None, also=None):
        if also:  # the NaN/inf flags of a reselection step (one process: no shard)
            out = self(items, state, ops, link, cfg)
            return out, {d: link.to_host(f).numpy() for d, f in also.items()}
        moves = []
        for group, p, g in items:
            g2d = L.view2d(g, like=p)
            cols = g2d.shape[1]
            k = S.num_selected(cols, cfg.topk_ratio)
            b1, b2 = group["betas"]
            if k in (0, cols):
                moves.append(S.Move(p, state[p], np.arange(k, dtype=np.int64), b1, b2))
                continue
            age = self.age.setdefault(id(p), np.zeros(cols))
            top = S.select_columns(ops.column_scores(g2d, cfg.score), k - k // 2).cpu().numpy()
            rest = np.setdiff1d(np.arange(cols), top)
            old = rest[np.argsort(-age[rest], kind="stable")[:k // 2]]
            idx = np.sort(np.concatenate([top, old])).astype(np.int64)
            age += 1
            age[idx] = 0
            moves.append(S.Move(p, state[p], idx, b1, b2))
        return moves


def run(factory, ts: TuneSettings, variant: str) -> float:
    cfg, sign, rotate = parse(variant)
    import zenflow_triton.columns.split as O  # where the reselection calls the column rule

    def make(params):
        opt = ZenFlowOptimizer(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                               weight_decay=ts.weight_decay,
                               **{"fresh_if_spread": False, **cfg})
        if sign:
            with_sign_steps(opt, sign)
        return opt

    plan = O.plan_selection
    if rotate:
        O.plan_selection = Rotating()
    try:
        return train_and_measure(factory, make, ts).heldout_loss
    finally:
        O.plan_selection = plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    for v in args.variants:
        parse(v)  # fail on a typo before any training
    if args.threads:
        torch.set_num_threads(args.threads)
    name, factory = load_workload_factory(None)
    rows = []
    for seed in args.seeds:
        ts = TuneSettings(workload=name, seed=seed)
        ref = measure_reference(factory, ts)["heldout_loss"]
        limit = quality_limit(ref, ts.loss_margin)
        for v in args.variants:
            loss = run(factory, ts, v)
            rows.append(dict(variant=v, seed=seed, loss=loss, adamw=ref, limit=limit))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{name}, {TuneSettings().steps} steps at lr {TuneSettings().lr}: held-out loss minus "
          f"the 2% guard's limit (<= 0 feasible), seeds {args.seeds}")
    print("| variant | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("| --- |" + " --- |" * (len(args.seeds) + 1))
    for v in args.variants:
        viol = [r["loss"] - r["limit"] for r in rows if r["variant"] == v]
        print(f"| {v} | " + " | ".join(f"{x:+.4f}" for x in viol)
              + f" | {sum(viol) / len(viol):+.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
