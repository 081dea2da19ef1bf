"""The README's "When it pays off" table: for each built-in GPU profile, ZenFlow at the
profile's settings against the strongest peer that fits (the fastest of ZeRO-Offload, its
one-step-delayed variant, per-layer overlapped offload and state-swap with as much Adam state
resident as fits), then the cases where the peers catch up: large per-GPU batches and FSDP2
over many GPUs. Step-model predictions (docs/stepmodel.md), not measurements.

    python bench/peers_table.py                      # Llama-3-8B, 4096 tokens per GPU
    python bench/peers_table.py --model qwen2.5-7b --tokens 16384
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import stepmodel as M  # noqa: E402
from zenflow_triton.profiles import list_profiles, load_profile  # noqa: E402

PEERS = ("zero-offload", "zero-offload-dpu", "overlapped-offload", "state-swap")
EXTRA = (  # (profile, gpus, sharding, tokens): where the peers are expected to catch up
    ("h100-sxm5", 1, "ddp", 65536), ("gh200", 1, "ddp", 65536),
    ("h100-sxm5", 8, "fsdp2", 4096), ("h100-sxm5", 8, "fsdp2", 65536))


def row(model: str, profile: str, gpus: int, sharding: str, tokens: int) -> str:
    prof = load_profile(profile)
    hw = M.Hardware.from_profile(prof)
    wl = M.Workload.from_spec(model, tokens=tokens)
    cfg = M.zenflow_config(prof.settings)
    kw = dict(gpus=gpus, sharding=sharding, config=cfg)
    zen = M.predict(hw, wl, "zenflow", **kw)
    setting = f"{cfg.topk_ratio:g} x {cfg.update_interval}"
    if not zen.fits:
        lean = M.fitting_zenflow(hw, wl, **kw)
        if lean is not None:
            zen = lean
            setting += " + " + ", ".join(f"{k}={v!r}" for k, v in M.lean_changes(lean, cfg).items())
    peers = {m: M.predict(hw, wl, m, **kw) for m in PEERS}
    fitting = {m: p for m, p in peers.items() if p.fits}
    head = (f"| `{profile}` | {gpus} ({sharding}) | {tokens} | {_link(hw)} | ")
    if not zen.fits:
        return head + "does not fit | - | - | - |"
    if not fitting:
        return head + f"{zen.step_time_s:.2f} s ({setting}) | nothing fits | - | ZenFlow |"
    best = min(fitting, key=lambda m: fitting[m].step_time_s)
    ratio = fitting[best].step_time_s / zen.step_time_s
    label = best
    if best == "state-swap":
        share = M.resident_that_fits(hw, wl, gpus=gpus, sharding=sharding, config=cfg)
        label = ("AdamW on the device (all state fits)" if share == 1.0
                 else f"state-swap, {share:.0%} resident")
    verdict = "ZenFlow" if ratio > 1.05 else ("peer" if ratio < 0.95 else "even")
    return (head + f"{zen.step_time_s:.2f} s ({setting}) | {label}: "
            f"{fitting[best].step_time_s:.2f} s | {ratio:.2f}x | {verdict} |")


def _link(hw: M.Hardware) -> str:
    """The link figures the model uses, GB/s: host to device / device to host, and host to
    device while device to host is busy where that is slower."""
    out = f"{hw.h2d / 1e9:.0f} / {hw.d2h / 1e9:.0f}"
    if hw.h2d_while_d2h < hw.h2d:
        out += f" ({hw.h2d_while_d2h / 1e9:g} to GPU while both busy)"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"{args.model}; device memory with the activations of the tokens (full recompute, "
          "fp32 logits) and 10% left free; the profile's ZenFlow settings (made leaner where "
          "they do not fit)")
    print()
    print("| profile | GPUs | tokens/GPU | link GB/s to GPU / to host | ZenFlow step | "
          "strongest peer that fits | peer / ZenFlow | faster |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    gpus = [p.name for p in list_profiles() if p.name != "cpu" and p.source == "builtin"]
    for name in gpus:
        print(row(args.model, name, 1, "ddp", args.tokens))
    for profile, n, sharding, tokens in EXTRA:
        print(row(args.model, profile, n, sharding, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
