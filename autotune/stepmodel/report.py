"""Predictions for people: a markdown table (step time, speed-up over a baseline mode,
stall, link bytes down and up, host busy fraction and memory on each side); a picture (one
steady-state window per mode on its four lanes, on a shared time axis, written as a PNG;
needs matplotlib, imported only when a plot is made); and the model against public
figures (DeepSpeed's ZenFlow blog: Llama-2-7B fine-tuning on 4x A100), with the
assumptions written down, a row per published quantity with the model's value and
relative error, and how fast a host would have to be to match the published CPU step."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .inputs import DEFAULT_ACCELERATORS_PER_NODE, DEFAULT_MFU, LANES, Hardware, StepModelError
from .workload import Workload
from .step import predict, predict_all
from .timeline import Prediction


def markdown_table(preds: Mapping[str, Prediction], baseline: str = "zero-offload") -> str:
    """A markdown table of predictions (step, speed-up over ``baseline``, stall, link, host
    busy, memory)."""
    base = preds.get(baseline)
    base_t = base.modelled_step_time_s if base is not None else None
    lines = ["| mode | step (s) | vs " + baseline + " | stall | link GB/step (down + up) | "
             "host busy | device GB | host GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in preds.items():
        t = p.modelled_step_time_s
        step = ("does not run" if t is None else f"{t:.3f}" if p.fits
                else f"({t:.3f}) does not fit")
        speed = f"{base_t / t:.2f}x" if base_t and t and p.fits else "-"
        stall = "-" if p.stall_fraction is None else f"{p.stall_fraction:.0%}"
        hb = "-" if p.host_busy_fraction is None else f"{p.host_busy_fraction:.0%}"
        lines.append(f"| {name} | {step} | {speed} | {stall} | "
                     f"{p.link_bytes_per_step / 1e9:.2f} ({p.link_down_bytes_per_step / 1e9:.2f}"
                     f" + {p.link_up_bytes_per_step / 1e9:.2f}) | {hb} | "
                     f"{p.device_memory_bytes / 1e9:.1f} | {p.host_memory_bytes / 1e9:.1f} |")
    return "\n".join(lines)


# ---- the picture --------------------------------------------------------------------------
_COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "grads down": "tab:orange",
           "params up": "tab:green", "host AdamW": "tab:red", "host accumulate": "salmon",
           "wait": "white"}


def plot_timelines(predictions: Mapping[str, Prediction] | Sequence[Prediction],
                   path: str | os.PathLike[str], title: str | None = None) -> Path:
    """One steady-state window per mode as lanes (device, link down, link up, host) on a
    shared time axis; writes a PNG. Needs matplotlib (imported here, lazily)."""
    try:
        import matplotlib
    except ImportError:
        raise StepModelError("plotting needs matplotlib: pip install matplotlib "
                             "(or pip install 'zenflow-triton[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    preds = list(predictions.values()) if isinstance(predictions, Mapping) else list(predictions)
    if not preds:
        raise StepModelError("plot_timelines: no predictions")
    fig, axes = plt.subplots(len(preds), 1, figsize=(11, 1.25 + 1.3 * len(preds)),
                             sharex=True, squeeze=False)
    xmax = max(p.window_time_s for p in preds)
    used: dict[str, str] = {}
    palette = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:gray",
                    "gold", "navy", "teal", "darkkhaki", "slategray"])
    for ax, p in zip(axes[:, 0], preds):
        for row, lane in enumerate(LANES):
            y = len(LANES) - 1 - row
            for s in p.timeline:
                if s.lane != lane or s.duration <= 0:
                    continue
                if s.label not in used:
                    used[s.label] = _COLORS.get(s.label) or next(palette, "black")
                ax.broken_barh([(s.start, s.duration)], (y - 0.4, 0.8),
                               facecolors=used[s.label], edgecolor="none")
        ax.set_yticks(range(len(LANES)))
        ax.set_yticklabels(list(reversed(LANES)), fontsize=8)
        ax.set_xlim(0, xmax * 1.01)
        step = (f"{p.step_time_s:.3f} s/step, stall {p.stall_fraction:.0%}" if p.fits
                else "does not fit in device memory")
        ax.set_title(f"{p.mode}: {p.window_steps} steps, {step}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time in one steady-state window (s)")
    handles = [Patch(color=c, label=lab) for lab, c in used.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- calibration against published figures ----------------------------------------------
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


# ---- state-swap against published measurements ---------------------------------------------
STATE_SWAP_SOURCES = (
    dict(source="NeMo-RL PR #3628 (optimizer_offload_fraction), 2026", model="qwen3-0.6b",
         profile="h100-sxm5", gpus=1, sharding="ddp", no_offload=0.752,
         runs=((0.5, 1.187), (0.0, 1.678)), zero_offload=None,
         memory_gib=(15.24, 14.13, 10.53),
         why=("one H100 as the PR (the SXM5 profile: the PR does not say which H100); the PR "
              "gives neither batch nor sequence, so the tokens per step are solved for so that "
              "the model's all-on-GPU step is the PR's 0.752 s; offload fraction f is resident "
              "share 1 - f; the PR's memory is the whole process's (activations included), so "
              "only its differences are compared")),
    dict(source="DeepSpeed PR #8186 (DeepCompile offload_opt_states), 2026", model="qwen3-14b",
         profile="h200-sxm", gpus=8, sharding="fsdp2", no_offload=1.89,
         runs=((0.0, 2.01),), zero_offload=10.11, memory_gib=None,
         why=("8x H200 as the PR, ZeRO-3 (every GPU holds 1/8 of params, gradients and "
              "state: the model's fsdp2); tokens per GPU per step solved for so that the "
              "model's all-on-GPU step is the PR's 1.89 (its unit: ratios are compared, "
              "not absolute times); every state offloaded (resident share 0)")),
)
"""Published state-swap measurements: step times without offload, with a share of the Adam
state offloaded (resident share, step), and with ZeRO-Offload where given."""


def _solve_tokens(hw: Hardware, model: str, gpus: int, sharding: str, step_s: float) -> int:
    """Tokens per GPU per step at which the model's all-on-GPU AdamW step takes ``step_s``
    (the step is increasing in tokens: bisection)."""
    def step(tokens: int) -> float:
        wl = Workload.from_preset(model, tokens=tokens)
        return predict(hw, wl, "adamw", gpus=gpus, sharding=sharding).modelled_step_time_s

    lo, hi = 1, 1 << 24
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if step(mid) < step_s else (lo, mid)
    return hi


def state_swap_calibration() -> list[dict[str, Any]]:
    """The state-swap mode (and ZeRO-Offload where published) against
    :data:`STATE_SWAP_SOURCES`: each step time as a ratio to the same setup without offload,
    published and modelled, and the relative error of the modelled ratio."""
    out = []
    for s in STATE_SWAP_SOURCES:
        hw = Hardware.from_profile(s["profile"])
        hw = dataclasses.replace(hw, device_memory_bytes=None)  # compare speed only
        tokens = _solve_tokens(hw, s["model"], s["gpus"], s["sharding"], s["no_offload"])
        wl = Workload.from_preset(s["model"], tokens=tokens)
        kw = dict(gpus=s["gpus"], sharding=s["sharding"])
        base = predict(hw, wl, "adamw", **kw).modelled_step_time_s
        cases = [(f"state-swap, {1 - r:.0%} offloaded", t,
                  predict(hw, wl, "state-swap", resident_fraction=r, **kw))
                 for r, t in s["runs"]]
        if s["zero_offload"]:
            cases.append(("ZeRO-Offload", s["zero_offload"],
                          predict(hw, wl, "zero-offload", dense_params=(), **kw)))
        for label, published, p in cases:
            want, got = published / s["no_offload"], p.modelled_step_time_s / base
            out.append(dict(source=s["source"], setup=f"{s['model']}, {s['gpus']}x "
                            f"{s['profile']}, {tokens} tokens/GPU/step (solved)",
                            case=label, published_ratio=want, model_ratio=got,
                            rel_error=(got - want) / want, why=s["why"]))
        if s["memory_gib"]:
            full, *_, none = s["memory_gib"]
            freed = (full - none) * 2**30
            state = predict(hw, wl, "state-swap", resident_fraction=0.0, **kw).host_memory_bytes
            out.append(dict(source=s["source"], setup=f"{s['model']}, 1x {s['profile']}",
                            case="device memory freed by offloading all state (GiB)",
                            published_ratio=freed / 2**30, model_ratio=state / 2**30,
                            rel_error=(state - freed) / freed, why=s["why"]))
    return out


def state_swap_calibration_table() -> str:
    rows = state_swap_calibration()
    lines = ["| source | setup | case | published (x no offload) | model | relative error |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['setup']} | {r['case']} | "
                     f"{r['published_ratio']:.3g} | {r['model_ratio']:.3g} | "
                     f"{r['rel_error']:+.0%} |")
    lines.append("")
    for s in STATE_SWAP_SOURCES:
        lines.append(f"Assumptions for {s['source']}: {s['why']}.")
    return "\n".join(lines)


PUBLISHED_PEERS = (
    dict(name="torchtune full_finetune_single_device (llama3_1/8B_full_single_device.yaml)",
         params_b=(7.0, 9.0), device_gb=(16, 32), peak_gib=18.9, tokens_per_s=1650.0,
         card="RTX 4090",
         what="bf16 params without an fp32 master, bnb paged 8-bit AdamW run inside "
              "backward (no full gradient resident), no gradient accumulation, clipping off",
         source="torchtune README, 'Memory and training speed' (Llama-3.1-8B, RTX 4090)"),
)
"""Peers with published figures and no graph of their own in the model: shown beside a
prediction where the model size and the card's memory match (``published_peers``)."""


def published_peers(hw: Hardware, wl: Workload) -> list[str]:
    """Notes on the published peers that match ``wl``'s size and ``hw``'s memory."""
    if hw.device_memory_bytes is None:
        return []
    gb, size = hw.device_memory_bytes / 1e9, wl.numel / 1e9
    out = []
    for p in PUBLISHED_PEERS:
        if p["params_b"][0] <= size <= p["params_b"][1] and p["device_gb"][0] <= gb <= p["device_gb"][1]:
            step = wl.tokens / p["tokens_per_s"]
            out.append(f"peer (published, not modelled): {p['name']}: {p['peak_gib']} GiB peak "
                       f"at {p['tokens_per_s']:g} tokens/s on an {p['card']}, "
                       f"{step:.2f} s per {wl.tokens} tokens; {p['what']} ({p['source']})")
    return out


ZERO3_OFFLOAD_RUNS = dict(
    source="SlideFormer's DeepSpeed baseline (bench/DeepSpeed/ds_bench_1024_bf16_on_20260224_"
           "211132.csv, commit a0ddba6; setup in bench/DeepSpeed/ds_bench.py)",
    setup="Llama-3.1-8B on one RTX 4090 (24 GB), ZeRO-3 with optimizer and param offload "
          "(pinned), sequences of 1024 tokens, HF gradient checkpointing, a fused linear "
          "cross-entropy (no fp32 logits), bf16; host CPU not stated; host memory peak 176.3 GB",
    runs=((8, 8.97), (16, 11.93), (32, 18.30)),   # (sequences per step, seconds per step)
    host_gb=176.3,   # host RSS peak, every batch
    why="one forward and backward pass a step: the GPU's allocated peak grows with the "
        "batch (8.5, 10.6, 16.4 GB), so each batch is one micro-batch, not accumulation; the "
        "model's nearest mode is zero-offload (ZeRO-1/2 offload: the params stay on the GPU, "
        "where ZeRO-3 also fetches them per layer over the link) and its delayed-update "
        "variant, at the profile rtx4090-pcie4 and MFU 0.4 (the runs reached 42.6-83.5 "
        "TFLOP/s, 0.26-0.51 of the card's 165)")
"""Published ZeRO-3 offload runs on a 24 GB desktop card: the step model's check at several
batch sizes (``bench/stepmodel_calibration.py``)."""


def zero_offload_calibration_table(profile: str = "rtx4090-pcie4",
                                   model: str = "llama3-8b") -> str:
    """The model's ZeRO-Offload step against :data:`ZERO3_OFFLOAD_RUNS`: one row per
    published batch, the modelled step of each mode and its relative error."""
    hw = Hardware.from_profile(profile)
    lines = ["| sequences x 1024 tokens | published s/step | zero-offload (model) | error | "
             "zero-offload-dpu (model) | error |", "| --- | --- | --- | --- | --- | --- |"]
    for seqs, published in ZERO3_OFFLOAD_RUNS["runs"]:
        wl = Workload.from_spec(model, tokens=1024 * seqs)
        cells = []
        for mode in ("zero-offload", "zero-offload-dpu"):
            t = predict(hw, wl, mode).modelled_step_time_s
            cells += [f"{t:.2f}", f"{t / published - 1:+.0%}"]
        lines.append(f"| {seqs} | {published:.2f} | " + " | ".join(cells) + " |")
    modelled, published = zero3_offload_host_gb(profile, model), ZERO3_OFFLOAD_RUNS["host_gb"]
    lines += ["", f"Host memory: the model's DeepSpeed ZeRO-Offload host side plus the bf16 "
              f"params ZeRO-3's param offload keeps in pinned host memory, {modelled:.1f} GB, "
              f"against the runs' host RSS peak of {published:.1f} GB: "
              f"{modelled / published - 1:+.0%} (the RSS also holds the process, the CUDA "
              "context's host side, the data and the pinned allocator's rounding).",
              "", f"Source: {ZERO3_OFFLOAD_RUNS['source']}. Setup: {ZERO3_OFFLOAD_RUNS['setup']}."
              f" Read as: {ZERO3_OFFLOAD_RUNS['why']}."]
    return "\n".join(lines)


def zero3_offload_host_gb(profile: str = "rtx4090-pcie4", model: str = "llama3-8b") -> float:
    """The host GB the model gives DeepSpeed ZeRO-3 with optimizer and param offload (the
    runs of :data:`ZERO3_OFFLOAD_RUNS`, one micro-batch of 8 x 1024 tokens): ``zero-offload``'s
    host side (fp32 master, m, v and the fp32 gradient partition,
    ``modes.zero_offload_host``) plus the params in the param dtype, which param offload
    keeps in pinned host memory (``offload_param: {device: cpu, pin_memory: true}``)."""
    hw, wl = Hardware.from_profile(profile), Workload.from_spec(model, tokens=8 * 1024)
    return (predict(hw, wl, "zero-offload").host_memory_bytes + wl.param_bytes * wl.numel) / 1e9
