"""``zenflow-tune predict``: the step-time model (:mod:`autotune.stepmodel`) of a model preset
on a hardware profile, every mode, as a table (or JSON) and optionally a plot."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import detect
from .. import modelled as MD
from .. import stepmodel as M
from . import EXIT_OK, UsageError


LOSS_WORDS = {"logits": "the loss's fp32 logits, --loss logits",
              "chunked": "the loss as a chunked cross-entropy, one chunk of logits at a time, "
                         "--loss chunked"}
"""What the header says of the loss the activations count (``Workload.loss``)."""


def cmd_predict(args: argparse.Namespace) -> int:
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.topk_ratio is not None and not 0 <= args.topk_ratio <= 1:
        raise UsageError(f"--topk-ratio must be in [0, 1], got {args.topk_ratio}")
    if args.resident_fraction is not None and not 0 <= args.resident_fraction <= 1:
        raise UsageError(f"--resident-fraction must be in [0, 1], got {args.resident_fraction}")
    try:  # unknown: ProfileNotFoundError names the known ones
        prof = MD.profile_of(args.profile, args.device_memory_gb, args.host_memory_gb)
    except MD.ModelledError as e:
        raise UsageError(f"--device-memory-gb / --host-memory-gb: {e}") from None
    measured = detect.measure_host_adam() if args.measure_host else None
    hw = M.Hardware.from_profile(prof, host_adam_elements_per_s=measured)
    wl = M.Workload.from_spec(args.model, tokens=args.tokens or M.DEFAULT_TOKENS,
                              mfu=args.mfu if args.mfu is not None else M.DEFAULT_MFU)
    wl = wl.replace(recompute=not args.no_recompute, loss=args.loss)
    if args.micro_batch_tokens is not None:
        if args.micro_batch_tokens > wl.tokens:
            raise UsageError(f"--micro-batch-tokens {args.micro_batch_tokens} exceeds --tokens "
                             f"{wl.tokens} (the tokens of a whole optimizer step)")
        wl = wl.replace(micro_batch_tokens=args.micro_batch_tokens)
    settings, overrides = _settings(args, prof.settings)
    cfg = M.zenflow_config(settings, **overrides)
    preds = {m: M.predict_fitting(hw, wl, m, gpus=args.gpus, config=cfg,
                                  sharding=args.sharding, resident_fraction=args.resident_fraction)
             for m in M.MODES}
    if args.plot:
        M.plot_timelines(preds, args.plot, title=f"{wl.name} on {hw.name}, {args.gpus} GPU(s), "
                                                 f"{wl.tokens} tokens/GPU/step (model)")
    if args.json:
        print(json.dumps({m: p.to_dict() for m, p in preds.items()}, indent=2))
        return EXIT_OK
    other = "host" if cfg.accumulate_on == "device" else "device"
    alt = M.predict_fitting(hw, wl, "zenflow", gpus=args.gpus,
                            config=cfg.replace(accumulate_on=other), sharding=args.sharding)
    shown = dict(preds)
    shown[f"zenflow (accumulate_on={other!r})"] = alt
    _print_report(args, hw, wl, cfg, shown)
    return EXIT_OK


def _settings(args: argparse.Namespace,
              profile_settings: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The profile's ZenFlow settings and the options that override them."""
    overrides = {k: v for k, v in (("topk_ratio", args.topk_ratio),
                                   ("update_interval", args.update_interval),
                                   ("select_interval", args.select_interval),
                                   ("apply_delay", args.apply_delay),
                                   ("accumulate_on", args.accumulate_on),
                                   ("accumulator_dtype", args.accumulator_dtype),
                                   ("host_state_dtype", args.host_state_dtype),
                                   ("stream_grads", args.stream_grads),
                                   ("dense_params", None if args.dense_params is None
                                    else tuple(args.dense_params))) if v is not None}
    # a profile's select_interval and apply_delay belong to its update_interval
    settings = {k: v for k, v in profile_settings.items()
                if not (k in ("select_interval", "apply_delay")
                        and ("update_interval" in overrides or k in overrides))}
    return settings, overrides


def _print_report(args: argparse.Namespace, hw: M.Hardware, wl: M.Workload, cfg: Any,
                  shown: dict[str, M.Prediction]) -> None:
    rate, how = hw.host_rate_and_source(args.gpus)
    print(f"Model prediction (not a measurement): {wl.name} ({wl.numel / 1e9:.2f}B params, "
          f"{wl.dtype}) on {hw.name}, {args.gpus} GPU(s) ({args.sharding}), {wl.tokens} "
          f"tokens per GPU per optimizer step, MFU {wl.mfu:g}; host AdamW {rate:.3g} "
          f"elements/s per GPU ({how}). Link: {hw.link_summary()}.")
    if args.sharding == "fsdp2" and args.gpus > 1:
        print("fsdp2: memory per GPU is its rows of the params, gradients and state; the "
              "all-gathered layers in flight and FSDP's own collectives are not modelled.")
    print(f"zenflow: topk_ratio={cfg.topk_ratio}, update_interval={cfg.update_interval}, "
          f"overlap={cfg.overlap}, apply_delay={cfg.effective_apply_delay}, "
          f"accumulate_on={cfg.accumulate_on!r}, accumulator_dtype="
          f"{cfg.accumulator_dtype!r}, host_state_dtype={cfg.host_state_dtype!r}, "
          f"stream_grads={cfg.stream_grads}, dense_params={cfg.dense_params!r}. Device "
          f"memory counts the activations of one micro-batch "
          f"({'full recompute' if wl.recompute else 'no recompute'}; {LOSS_WORDS[wl.loss]}) "
          f"and a fit leaves {M.DEVICE_HEADROOM:.0%} free; docs/stepmodel.md has the formulas.")
    how = ("as given" if wl.micro_batch_tokens else
           f"each mode's largest that fits, at most {M.MICRO_BATCH_CAP}")
    print("Micro-batches (passes x tokens; " + how + "): " + ", ".join(
        f"{m} {p.micro_batches} x {p.micro_batch_tokens}" for m, p in shown.items()) + ".")
    print()
    print(M.markdown_table(shown))
    notes = [f"{m}: {n}" for m, p in shown.items() for n in p.notes]
    notes += _what_fits(args, hw, wl, cfg, shown["zenflow"])
    notes += M.published_peers(hw, wl)
    if notes:
        print()
        for n in notes:
            print(f"* {n}")
    if not args.no_curve:
        _print_curve(args, hw, wl, cfg)
    if args.plot:
        print(f"\nwrote {args.plot}")


def _print_curve(args: argparse.Namespace, hw: M.Hardware, wl: M.Workload, cfg: Any) -> None:
    """ZenFlow's speed-up over its fastest peer at 4k-256k tokens per step: the verdict is
    a curve over the batch, never one figure."""
    points = M.batch_curve(hw, wl, config=cfg, gpus=args.gpus, sharding=args.sharding,
                           resident_fraction=args.resident_fraction)
    print("\nZenFlow against the fastest peer that fits, by tokens per optimizer step (each "
          "mode at its largest micro-batch that fits, at most "
          f"{M.MICRO_BATCH_CAP} tokens):\n")
    print(M.curve_table(points))
    print(f"\n{M.verdict(points)}")


def _what_fits(args: argparse.Namespace, hw: M.Hardware, wl: M.Workload, cfg: Any,
               zen: M.Prediction) -> list[str]:
    """When ZenFlow at these settings fits no micro-batch: the leaner ZenFlow setting that
    fits at the largest micro-batch where one does, or why nothing can (the params,
    gradients and the smallest micro-batch's activations alone)."""
    if zen.fits or hw.device_memory_bytes is None:
        return []
    gb = hw.device_memory_bytes / 1e9
    smallest = wl.replace(micro_batch_tokens=zen.micro_batch_tokens)
    floor = M.params_and_grads_bytes(smallest, gpus=args.gpus, sharding=args.sharding) / 1e9
    usable = hw.usable_device_bytes / 1e9
    if floor > usable:
        return [f"nothing fits: the params ({wl.dtype}), two buckets of the largest matrix's "
                f"gradient and the activations of {smallest.micro_tokens} tokens alone need "
                f"{floor:.1f} GB of the device's {usable:.1f} usable GB, before any optimizer "
                "state; shard them (--gpus N --sharding fsdp2) or take a larger card"]
    best = M.fitting_zenflow_at_batch(hw, wl, gpus=args.gpus, config=cfg,
                                      sharding=args.sharding)
    if best is None:
        return [f"no leaner ZenFlow setting fits {gb:.0f} GB in micro-batches down to "
                f"{smallest.micro_tokens} tokens (params, gradient buckets and activations: "
                f"{floor:.1f} GB of {usable:.1f} usable; tried {', '.join(M.LEAN_CHOICES)})"]
    changed = M.lean_changes(best, cfg)
    return [f"fits: zenflow with {', '.join(f'{k}={v!r}' for k, v in changed.items())} in "
            f"micro-batches of {best.micro_batch_tokens} tokens: {best.step_time_s:.3f} s/step, "
            f"{best.device_memory_bytes / 1e9:.1f} GB device, "
            f"{best.host_memory_bytes / 1e9:.1f} GB host (a prediction; the quality of these "
            "settings: docs/quality.md)"]
