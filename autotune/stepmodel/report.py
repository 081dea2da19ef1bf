"""Predictions as a markdown table: step time, speed-up over a baseline mode, stall, link
bytes down and up, host busy fraction and memory on each side."""

from __future__ import annotations

from typing import Mapping

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
        step = f"{t:.3f}" if p.fits else f"({t:.3f}) does not fit"
        speed = f"{base_t / t:.2f}x" if base_t and t and p.fits else "-"
        stall = "-" if p.stall_fraction is None else f"{p.stall_fraction:.0%}"
        hb = "-" if p.host_busy_fraction is None else f"{p.host_busy_fraction:.0%}"
        lines.append(f"| {name} | {step} | {speed} | {stall} | "
                     f"{p.link_bytes_per_step / 1e9:.2f} ({p.link_down_bytes_per_step / 1e9:.2f}"
                     f" + {p.link_up_bytes_per_step / 1e9:.2f}) | {hb} | "
                     f"{p.device_memory_bytes / 1e9:.1f} | {p.host_memory_bytes / 1e9:.1f} |")
    return "\n".join(lines)
