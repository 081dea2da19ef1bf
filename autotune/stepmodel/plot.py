"""Predictions as a picture: one steady-state window per mode on its four lanes, on a
shared time axis, written as a PNG. Needs matplotlib, imported only when a plot is made."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from .base import LANES, StepModelError
from .timeline import Prediction


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
