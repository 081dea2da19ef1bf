"""The README's "Fit my GPU" table: for Llama-3-8B and Qwen2.5-7B on a 24, a 40 and an 80 GB
card, the setting the modelled tuner picks (``zenflow-tune run --objective modelled``, its
quality from the real-model store: ``autotune/data/real_quality.json``) at 4096 tokens per
optimizer step (``--tokens``), each setting in its largest micro-batches that fit, its
device memory (activations counted,
10% left free) and host memory, its modelled step beside every peer mode the step model has
(ZeRO-Offload and its variants, state-swap, AdamW where it fits), and that setting's measured
quality on the store's real-model workloads; or why nothing fits.

    python bench/fit_table.py                  # markdown table (nothing trained: minutes)
    python bench/fit_table.py --tokens 65536   # at a fine-tune's usual batch

Speed is the step model's (a prediction: docs/stepmodel.md), quality the convergence study's
(bench/convergence/), nothing measured on these cards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import modelled as MD  # noqa: E402

CARDS = (("RTX 4090 24 GB", "rtx4090-pcie4", None), ("A100 40 GB", "a100-pcie4", 40.0),
         ("A100 80 GB", "a100-pcie4", None))
MODELS = ("llama3-8b", "qwen2.5-7b")


def row(card: str, profile: str, memory: float | None, model: str, bar: str,
        tokens: int) -> str:
    """The tuner's pick at ``tokens`` per optimizer step, each setting in its largest
    micro-batches that fit (at most 4096 tokens), or why nothing qualifies."""
    prof = MD.profile_of(profile, memory)
    head = f"| {model} | {card} |"
    out = MD.run_modelled(profile=prof, model=model, tokens=tokens, quality="real", bar=bar,
                          log=lambda s: None)
    if out.best is None:
        fitting = [r for r in out.rows if r.fits]
        if not fitting:
            return head + f" nothing measured fits ({'; '.join(out.notes)}) | - | - | - | - |"
        fastest = MD.fastest_peer(out)
        failed = "; ".join(
            f"{r.point.settings['topk_ratio']:g} x {r.point.settings['update_interval']} "
            f"{MD.device_side(r.settings)} fits ({r.step_time_s:.2f} s) but "
            f"{r.point.verdict.summary()}" for r in fitting)
        peer = f"{fastest[1]} {fastest[0]:.2f} s" if fastest else "none fits"
        return (head + f" no measured setting both fits and stays within the bar at "
                f"{tokens} tokens: {failed} | - | - | {peer}: the tuner names it | - |")
    b = out.best
    s, p = b.settings, b.prediction
    step = b.step_time_s
    fastest = MD.fastest_peer(out)
    peer = (f"{fastest[1]} {fastest[0]:.2f} s ({fastest[0] / step:.2f}x ZenFlow's)" if fastest
            else "none fits")
    v = b.point.verdict
    return (head + f" {s['topk_ratio']:g} x {s['update_interval']}"
            f"{', delay ' + str(s['apply_delay']) if s.get('apply_delay') else ''}"
            f"{', window betas' if s.get('host_betas') == 'window' else ''}, "
            f"{MD.device_side(s)}, {tokens} tokens in {p.micro_batches} x "
            f"{p.micro_batch_tokens} | {p.device_memory_bytes / 1e9:.1f} / "
            f"{p.host_memory_bytes / 1e9:.0f} | {step:.2f} | {peer} | "
            f"{v.name}: {'; '.join(r.describe() for r in v.results)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality-bar", default=MD.DEFAULT_BAR, choices=("tuned", "default"))
    ap.add_argument("--tokens", type=int, default=4096,
                    help="tokens per GPU per optimizer step (default 4096)")
    args = ap.parse_args(argv)
    print("| model | card | tuner's setting (topk x interval, device side, tokens per step) "
          "| device / host GB | step s (model) | fastest peer that fits (model) "
          "| measured quality of the setting: loss vs AdamW (nats) / accuracy, per workload |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in MODELS:
        for card, profile, memory in CARDS:
            print(row(card, profile, memory, model, args.quality_bar, args.tokens), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
