"""The README's "When it pays off" table: for each built-in GPU profile, ZenFlow at the
profile's settings against the fastest peer that fits (AdamW on the device, ZeRO-Offload, its
one-step-delayed variant, per-layer overlapped offload, state-swap with as much Adam state
resident as fits), at 4k, 16k, 64k and 256k tokens per optimizer step, each mode in the
largest micro-batches that fit (at most 4096 tokens); where the profile's ZenFlow setting
fits no micro-batch, the leaner one that does (the cell names what it changes). Step-model
predictions
(docs/stepmodel.md), not measurements.

    python bench/peers_table.py                      # Llama-3-8B, one GPU per profile
    python bench/peers_table.py --model qwen2.5-7b --plot curve.png
    python bench/peers_table.py --gpus 8 --sharding fsdp2 --profiles h100-sxm5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import stepmodel as M  # noqa: E402
from zenflow_triton.profiles import list_profiles, load_profile  # noqa: E402


def curve(model: str, profile: str, gpus: int, sharding: str,
          loss: str = "logits") -> list[M.BatchPoint]:
    prof = load_profile(profile)
    hw = M.Hardware.from_profile(prof)
    wl = M.Workload.from_spec(model).replace(loss=loss)
    return M.batch_curve(hw, wl, config=M.zenflow_config(prof.settings), gpus=gpus,
                         sharding=sharding, lean=True)


def cell(pt: M.BatchPoint, cfg) -> str:
    if not pt.zenflow.fits:
        return "ZenFlow does not fit" + (f" ({pt.peer} does)" if pt.peer else "")
    lean = M.lean_changes(pt.zenflow, cfg)
    how = f" (leaner: {', '.join(_short(k, v) for k, v in lean.items())})" if lean else ""
    if pt.peer is None:
        return "only ZenFlow fits" + how
    return f"{pt.speedup:.2f}x vs {pt.peer}{how}"


def _short(key: str, value) -> str:
    """A leaner setting's change in a few words."""
    if key == "topk_ratio":
        return f"topk {value:g}"
    return {"accumulate_on": "summed on the host", "dense_params": "no dense set",
            "stream_grads": "streamed", "accumulator_dtype": f"{value} sums",
            "host_state_dtype": f"{value} host moments"}.get(
                key, f"{key}={value!r}")


def _setting(profile: str) -> str:
    s = load_profile(profile).settings
    return f"{s.get('topk_ratio', 0.1):g} x {s.get('update_interval', 4)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--profiles", nargs="+", default=None,
                    help="built-in GPU profiles (default: all of them)")
    ap.add_argument("--loss", choices=M.LOSSES, default="chunked",
                    help="the loss's memory, for every mode alike (default chunked: "
                         "zenflow_triton.causal_lm_loss; logits: an HF model's fp32 logits)")
    ap.add_argument("--plot", metavar="PNG", help="also draw the speed-up curves (matplotlib)")
    args = ap.parse_args(argv)
    names = args.profiles or [p.name for p in list_profiles()
                              if p.name != "cpu" and p.source == "builtin"]
    print(f"{args.model}, {args.gpus} GPU(s) ({args.sharding}): ZenFlow's step time over the "
          "fastest peer's that fits (> 1: ZenFlow is faster), by tokens per optimizer step; "
          "each mode in its largest micro-batches that fit (at most 4096 tokens), device memory "
          f"with the activations of one micro-batch (full recompute, loss: {args.loss}), 10% "
          "left free; host memory in full where the profile states the host's")
    print()
    heads = " | ".join(f"{t // 1024}k tokens" for t in M.CURVE_TOKENS)
    print(f"| profile (ZenFlow setting) | {heads} |")
    print("| --- |" + " --- |" * len(M.CURVE_TOKENS))
    curves = {}
    for name in names:
        points = curve(args.model, name, args.gpus, args.sharding, args.loss)
        curves[name] = points
        cfg = M.zenflow_config(load_profile(name).settings)
        print(f"| `{name}` ({_setting(name)}) | " + " | ".join(cell(p, cfg) for p in points)
              + " |")
    if args.plot:
        M.plot_curves(curves, args.plot, title=f"{args.model}, {args.gpus} GPU(s): ZenFlow "
                                                "against its fastest peer (model)")
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
