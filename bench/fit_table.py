"""The README's "Fit my GPU" table: for Llama-3-8B and Qwen2.5-7B on a 24, a 40 and an 80 GB
card, the setting the modelled tuner picks (``zenflow-tune run --objective modelled``) at
4096 tokens per step (fewer where the activations leave no room), its device memory
(activations counted, 10% left free) and host memory, its modelled step against ZeRO-Offload and state-swap (as much Adam
state resident as fits), and the measured quality of that setting's class on the
convergence workloads (``bench/convergence/data/convergence.json``); or why nothing fits.

    python bench/fit_table.py            # markdown table (trains the tuner's quality grid
                                         # points it lacks: minutes, once per machine)

Speed is the step model's (a prediction: docs/stepmodel.md), quality the tuner's guard on its
CPU workload plus the convergence study's rows, nothing measured on these cards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import modelled as MD  # noqa: E402
from autotune import stepmodel as M  # noqa: E402

CARDS = (("RTX 4090 24 GB", "rtx4090-pcie4", None), ("A100 40 GB", "a100-pcie4", 40.0),
         ("A100 80 GB", "a100-pcie4", None))
MODELS = ("llama3-8b", "qwen2.5-7b")
CONVERGENCE = Path(__file__).resolve().parent / "convergence" / "data" / "convergence.json"
CLASSES = {"dense": "zenflow-adaptive-dense", "lean": "zenflow-lean"}
"""A setting's class (its device side) -> the convergence study's optimizer of that class
(0.1 x 4, the adaptive step size)."""


def class_quality(rows: list[dict], optimizer: str) -> str:
    """Held-out loss (and accuracy) against AdamW on the same seeds, per workload, mean of the
    seeds the study has for ``optimizer``."""
    out = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        ref = {r["seed"]: r["final"] for r in rows
               if r["workload"] == wl and r["optimizer"] == "adamw"}
        mine = [r for r in rows if r["workload"] == wl and r["optimizer"] == optimizer
                and r["seed"] in ref]
        if not mine:
            continue
        dl = statistics.mean(r["final"]["loss"] - ref[r["seed"]]["loss"] for r in mine)
        acc = [r["final"].get("accuracy") for r in mine]
        text = f"{wl} {dl:+.3f}"
        if all(a is not None for a in acc):
            da = statistics.mean(100 * (r["final"]["accuracy"] - ref[r["seed"]]["accuracy"])
                                 for r in mine)
            text += f" / {da:+.1f} pts"
        out.append(f"{text} ({len(mine)} seed{'s' * (len(mine) > 1)})")
    return "; ".join(out) or "not measured"


def row(card: str, profile: str, memory: float | None, model: str, quality_rows) -> str:
    """The tuner's pick at 4096 tokens per step, or, where the activations leave no room, at
    the most tokens (halved down to 1024) at which one fits."""
    prof = MD.profile_of(profile, memory)
    hw = M.Hardware.from_profile(prof)
    head = f"| {model} | {card} |"
    out = why = None
    for tokens in (4096, 2048, 1024):
        wl = M.Workload.from_spec(model, tokens=tokens)
        floor = M.params_and_grads_bytes(wl) / 1e9
        if floor > hw.usable_device_bytes / 1e9:
            why = (f"does not fit: bf16 params, gradient buckets and activations of {tokens} "
                   f"tokens alone are {floor:.1f} GB")
            continue
        out = MD.run_modelled(profile=prof, model=model, tokens=tokens, log=lambda s: None)
        if out.best is not None:
            break
        why = f"no setting fits or passes the guard ({'; '.join(out.notes)})"
    if out is None or out.best is None:
        return head + f" {why} | - | - | - | - | - |"
    swap = M.predict(hw, wl, "state-swap")
    zo = M.predict(hw, wl, "zero-offload")
    b = out.best
    s = b.settings
    side = MD.device_side(s)
    cls = "lean" if side.startswith("lean") else "dense"
    step = b.step_time_s

    def vs(p: M.Prediction) -> str:
        return (f"{p.modelled_step_time_s / step:.2f}x ({p.modelled_step_time_s:.2f} s)"
                if p.fits else "does not fit")

    return (head + f" {s['topk_ratio']:g} x {s['update_interval']}, {side}, {wl.tokens} "
            f"tokens | "
            f"{b.prediction.device_memory_bytes / 1e9:.1f} / "
            f"{b.prediction.host_memory_bytes / 1e9:.0f} | {step:.2f} | {vs(zo)} | {vs(swap)} | "
            f"{cls}: {class_quality(quality_rows, CLASSES[cls])} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--convergence", default=str(CONVERGENCE))
    args = ap.parse_args(argv)
    with open(args.convergence) as f:
        rows = json.load(f)
    print("| model | card | tuner's setting (topk x interval, device side, tokens per step) "
          "| device / host GB "
          "| step s (model) | ZeRO-Offload step (x ZenFlow's) | state-swap step (x ZenFlow's) "
          "| measured quality of the class, loss vs AdamW (nats) / accuracy |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for card, profile, memory in CARDS:
            print(row(card, profile, memory, model, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
