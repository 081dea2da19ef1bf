"""The README's "Fit my GPU" tables: what the modelled tuner picks
(``zenflow-tune run --objective modelled``, its quality from the real-model store:
``autotune/data/real_quality.json``) for Llama-3-8B, Qwen2.5-7B and Mistral-7B on a 24 GB
desktop card (RTX 4090 or 3090) with 128 or 64 GB of RAM, and on a 40 and an 80 GB A100,
at a small and a usual batch (tokens per optimizer step), each setting in its largest
micro-batches that fit (device memory counts one micro-batch's activations and leaves 10%
free; host memory counts every host buffer and leaves 10% free); beside it the fastest peer
mode that fits (ZeRO-Offload and its variants, state-swap, AdamW), or why nothing fits.

    python bench/fit_table.py                     # the README's table (compact, minutes)
    python bench/fit_table.py --full              # one row per batch, memory and quality
    python bench/fit_table.py --cards desktop     # only the 24 GB desktops
    python bench/fit_table.py --loss logits       # with the fp32 logits an HF model makes

Speed is the step model's (a prediction: docs/stepmodel.md), quality the convergence study's
(bench/convergence/), nothing measured on these cards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import modelled as MD  # noqa: E402

DESKTOP = (("RTX 4090", "rtx4090-pcie4", None, 128.0), ("RTX 4090", "rtx4090-pcie4", None, 64.0),
           ("RTX 3090", "rtx3090-pcie4", None, 128.0), ("RTX 3090", "rtx3090-pcie4", None, 64.0))
"""(card, profile, device GB (None: the profile's), host GB) of a desktop with one card."""
DATACENTER = (("A100 40 GB", "a100-pcie4", 40.0, None), ("A100 80 GB", "a100-pcie4", None, None))
CARDS = {"desktop": DESKTOP, "datacenter": DATACENTER, "all": DESKTOP + DATACENTER}
MODELS = ("llama3-8b", "qwen2.5-7b", "mistral-7b")
BATCHES = (4096, 65536)
"""A small batch (one or two sequences) and a fine-tune's usual one (32 sequences of 2048)."""


def outcome(profile: str, device_gb: float | None, host_gb: float | None, model: str,
            tokens: int, bar: str, **kw) -> MD.ModelledOutcome:
    prof = MD.profile_of(profile, device_gb, host_gb)
    return MD.run_modelled(profile=prof, model=model, tokens=tokens, quality="real", bar=bar,
                           log=lambda s: None, **kw)


def setting(row: MD.ModelledRow) -> str:
    s = row.settings
    return (f"{s['topk_ratio']:g} x {s['update_interval']}"
            f"{', delay ' + str(s['apply_delay']) if s.get('apply_delay') else ''}"
            f"{', window betas' if s.get('host_betas') == 'window' else ''}, "
            f"{MD.memory_side(s)}")


def why_not(out: MD.ModelledOutcome) -> str:
    """Why the tuner picked no ZenFlow setting: the rows that fit but failed the bar, or
    that nothing measured fits (the model's notes say which memory)."""
    fitting = [r for r in out.rows if r.fits]
    if not fitting:
        return "no measured ZenFlow setting fits (" + "; ".join(out.notes) + ")"
    return "no ZenFlow setting both fits and passes: " + "; ".join(
        f"{setting(r)} fits ({r.step_time_s:.2f} s) but {r.point.verdict.summary()}"
        for r in fitting)


def peer_text(out: MD.ModelledOutcome, step: float | None = None) -> str:
    fastest = MD.fastest_peer(out)
    if fastest is None:
        return "no peer fits"
    ratio = f" ({fastest[0] / step:.2f}x ZenFlow's)" if step else ""
    return f"{fastest[1]} {fastest[0]:.2f} s{ratio}"


def short_why(out: MD.ModelledOutcome, p) -> str:
    """Why a peer's prediction does not fit, in a few words."""
    hw = out.hardware
    if p.step_time_s is None and p.host_memory_bytes == 0:
        return "cannot accumulate micro-batches"
    if hw.usable_device_bytes and p.device_memory_bytes > hw.usable_device_bytes:
        return f"needs {p.device_memory_bytes / 1e9:.0f} GB of device memory"
    if hw.usable_host_bytes and p.host_memory_bytes > hw.usable_host_bytes:
        return (f"needs {p.host_memory_bytes / 1e9:.0f} GB of host memory "
                f"({hw.usable_host_bytes / 1e9:.0f} usable)")
    return "fits"


def compact_cell(out: MD.ModelledOutcome) -> str:
    """One batch's verdict in a few words: ZenFlow's pick and its step, or the peer to use."""
    b = out.best
    if b is not None:
        return f"**{setting(b)}**: {b.step_time_s:.2f} s; {peer_text(out, b.step_time_s)}"
    return peer_verdict(out, full=False)


def peer_verdict(out: MD.ModelledOutcome, full: bool) -> str:
    """Where no ZenFlow setting qualifies: the peer to use and why, or why no mode fits
    (``full``: every mode's reason; otherwise the one closest to fitting the host)."""
    fastest = MD.fastest_peer(out)
    fitting = [r for r in out.rows if r.fits]
    unmeasured = (" (ZenFlow would fit with bf16 host moments, not yet measured)"
                  if any("host_state_dtype='bfloat16' would fit" in n for n in out.notes)
                  else "")
    if fastest is None:
        if full:
            return "no mode fits: " + ", ".join(
                f"{m} {short_why(out, p)}" for m, p in out.peers.items() if m != "adamw"
            ) + unmeasured
        hw = out.hardware
        on_device = [(p.host_memory_bytes, m) for m, p in out.peers.items()
                     if m != "adamw" and p.host_memory_bytes > 0 and not (
                         hw.usable_device_bytes
                         and p.device_memory_bytes > hw.usable_device_bytes)]
        if on_device and hw.usable_host_bytes:
            need, m = min(on_device)
            return (f"no mode fits the host: {m} needs {need / 1e9:.0f} GB "
                    f"({hw.usable_host_bytes / 1e9:.0f} usable){unmeasured}")
        return "no mode fits" + unmeasured
    reason = ("no measured ZenFlow setting fits" if not fitting else
              "ZenFlow's settings that fit fail the quality bar")
    return f"use **{fastest[1]}** ({fastest[0]:.2f} s): {reason}{unmeasured}"


def compact_row(model: str, card: str, host_gb: float | None,
                outs: list[MD.ModelledOutcome]) -> str:
    """The README's row of one model and card: a cell per batch."""
    ram = f"{host_gb:g} GB" if host_gb else "-"
    return f"| {model} | {card} | {ram} | " + " | ".join(compact_cell(o) for o in outs) + " |"


def full_row(card: str, host_gb: float | None, model: str, tokens: int,
             out: MD.ModelledOutcome) -> str:
    head = f"| {model} | {card} | {f'{host_gb:g}' if host_gb else '-'} | {tokens} |"
    b = out.best
    if b is None:
        return (head + f" {why_not(out)} | - | - | {peer_verdict(out, full=True)} | - |")
    p, v = b.prediction, b.point.verdict
    return (head + f" {setting(b)}, {p.micro_batches} x {p.micro_batch_tokens} | "
            f"{p.device_memory_bytes / 1e9:.1f} / {p.host_memory_bytes / 1e9:.0f} | "
            f"{b.step_time_s:.2f} | {peer_text(out, b.step_time_s)} | "
            f"{v.name}: {'; '.join(r.describe() for r in v.results)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quality-bar", default=MD.DEFAULT_BAR, choices=("tuned", "default"))
    ap.add_argument("--cards", choices=sorted(CARDS), default="all")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(BATCHES),
                    help="tokens per GPU per optimizer step (default: 4096 65536)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), metavar="PRESET")
    ap.add_argument("--loss", choices=("chunked", "logits"), default="chunked",
                    help="the loss's memory, for every mode alike (default chunked: "
                         "zenflow_triton.causal_lm_loss, docs/howto-24gb.md)")
    ap.add_argument("--full", action="store_true",
                    help="one row per batch: micro-batches, memory, quality per workload")
    args = ap.parse_args(argv)
    cards = CARDS[args.cards]
    if args.full:
        print("| model | card | host RAM GB | tokens per step | tuner's setting (topk x "
              "interval, memory side, micro-batches) | device / host GB | step s (model) | "
              "fastest peer that fits (model) | measured quality: loss vs AdamW (nats) / "
              "accuracy, per workload |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    else:
        print("| model | card | host RAM | " + " | ".join(
            f"{t // 1024}k tokens per step" for t in args.tokens) + " |")
        print("| --- | --- | --- |" + " --- |" * len(args.tokens))
    for model in args.models:
        for card, profile, device_gb, host_gb in cards:
            outs = [outcome(profile, device_gb, host_gb, model, t, args.quality_bar,
                            loss=args.loss)
                    for t in args.tokens]
            if args.full:
                for t, out in zip(args.tokens, outs):
                    print(full_row(card, host_gb, model, t, out), flush=True)
            else:
                print(compact_row(model, card, host_gb, outs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
