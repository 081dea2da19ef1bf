"""The model against public figures: DeepSpeed's ZenFlow blog (Llama-2-7B fine-tuning on 4x
A100), with the assumptions written down, a row per published quantity with the model's
value and relative error, and how fast a host would have to be to match the published CPU
step."""

from __future__ import annotations

from typing import Any

from .base import DEFAULT_ACCELERATORS_PER_NODE, DEFAULT_MFU
from .hardware import Hardware
from .step import predict, predict_all
from .workload import Workload


CALIBRATION_SOURCE = ("DeepSpeed ZenFlow blog, blogs/deepspeed-zenflow/README.md in "
                      "deepspeedai/DeepSpeed (2025): Llama-2-7B fine-tuning on 4x A100")
CALIBRATION_ASSUMPTIONS = dict(
    profile="a100-pcie4", model="llama2-7b", gpus=4, tokens=2048, seq_len=256, mfu=DEFAULT_MFU,
    topk_ratio=0.1, update_interval=4, accumulate_on="host",
    why=("4 GPUs as the blog; tokens per GPU per step 8 x 256 (batch 8 as in DeepSpeedExamples' "
         "ZenFlow Llama-2 fine-tuning script, Alpaca-length sequences: an assumption); MFU the "
         "model's default; ZenFlow topk_ratio=0.1, update_interval=4 as in that script's config; "
         "accumulate_on='host' because DeepSpeed's ZenFlow sums the deferred gradients on the "
         "CPU (they cross every step); host AdamW rate: the a100-pcie4 profile has none, so the "
         "model's default per core (16 cores per GPU x 1e8/s), not fitted to the blog"))


def calibration(**overrides: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The model against the blog's figures: rows of (quantity, published, model, relative
    error), and the assumptions used (``overrides`` change them)."""
    a = {**CALIBRATION_ASSUMPTIONS, **overrides}
    hw = Hardware.from_profile(a["profile"])
    wl = Workload.from_preset(a["model"], tokens=a["tokens"], seq_len=a["seq_len"], mfu=a["mfu"])
    preds = predict_all(hw, wl, gpus=a["gpus"], topk_ratio=a["topk_ratio"],
                        update_interval=a["update_interval"], accumulate_on=a["accumulate_on"],
                        dense_params=())  # DeepSpeed's ZenFlow splits every matrix
    n = a["gpus"]
    model_bytes = wl.numel * wl.param_bytes
    zo, zf, ad = preds["zero-offload"], preds["zenflow"], preds["adamw"]
    host_step = (sum(p.numel for p in wl.params if p.is_matrix(4096)) / n) / hw.host_rate(n)
    rows = [
        ("step, all on GPU (s)", 0.5, "about", ad.modelled_step_time_s, "adamw (state sharded)"),
        ("step, ZeRO-Offload (s)", 7.0, "over", zo.modelled_step_time_s, "zero-offload"),
        ("CPU optimizer step, ZeRO-Offload (s)", 4.0, "over", host_step,
         "host AdamW of one GPU's 1/4 shard"),
        ("GPU idle share, ZeRO-Offload", 0.6, "over", zo.stall_fraction, "stall fraction"),
        ("link bytes/step, ZeRO-Offload (x model size)", 2.0, "about",
         zo.link_bytes_per_step * n / model_bytes, "all GPUs' link bytes / bf16 model bytes"),
        ("link bytes/step, ZenFlow (x model size)", 1.13, "about",
         zf.link_bytes_per_step * n / model_bytes, "accumulate_on='host'"),
    ]
    out = [dict(quantity=q, published=v, qualifier=qual, model=m, rel_error=(m - v) / v,
                consistent=(m >= v if qual == "over" else abs(m - v) <= 0.2 * v), note=note)
           for q, v, qual, m, note in rows]
    rate, how = hw.host_rate_and_source(n)
    a["host_adam_elements_per_s_per_gpu"] = rate
    a["host_rate_source"] = how
    a["implied_host_rate_for_4s"] = (sum(p.numel for p in wl.params if p.is_matrix(4096))
                                     / n / 4.0)
    return out, a


def calibration_table(**overrides: Any) -> str:
    rows, a = calibration(**overrides)
    sens = predict(Hardware.from_profile(a["profile"], host_adam_elements_per_s=(
        a["implied_host_rate_for_4s"] * min(a["gpus"], DEFAULT_ACCELERATORS_PER_NODE))),
        Workload.from_preset(a["model"], tokens=a["tokens"], seq_len=a["seq_len"], mfu=a["mfu"]),
        "zero-offload", gpus=a["gpus"])
    lines = [f"Source: {CALIBRATION_SOURCE}.",
             f"Assumptions: profile {a['profile']}, {a['model']}, {a['gpus']} GPUs, "
             f"{a['tokens']} tokens per GPU per step (sequences of {a['seq_len']}), MFU "
             f"{a['mfu']}, host AdamW {a['host_adam_elements_per_s_per_gpu']:.3g} elements/s "
             f"per GPU ({a['host_rate_source']}); ZenFlow topk_ratio={a['topk_ratio']}, "
             f"update_interval={a['update_interval']}, accumulate_on={a['accumulate_on']!r}.",
             "",
             "| quantity | published | model | relative error | consistent | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['quantity']} | {r['qualifier']} {r['published']:g} | "
                     f"{r['model']:.3g} | {r['rel_error']:+.0%} | "
                     f"{'yes' if r['consistent'] else 'no'} | {r['note']} |")
    lines.append("")
    lines.append("consistent: 'over X' holds when the model gives at least X; 'about X' when it "
                 "is within 20% of X.")
    lines.append(f"Sensitivity, not a fit: a host AdamW rate of "
                 f"{a['implied_host_rate_for_4s']:.3g} elements/s per GPU would make the CPU "
                 f"step take the published 4 s; the model's ZeRO-Offload step would then be "
                 f"{sens.modelled_step_time_s:.2f} s (stall {sens.stall_fraction:.0%}).")
    return "\n".join(lines)
