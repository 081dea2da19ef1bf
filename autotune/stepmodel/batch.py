"""The run a user makes: a step of many tokens in micro-batches that fit, and ZenFlow's speed
against its fastest peer as a function of tokens per optimizer step.

* :func:`predict_fitting`: a mode at the largest micro-batch that fits the device (at most
  :data:`MICRO_BATCH_CAP` tokens, halved down to :data:`MIN_MICRO_BATCH`), unless the
  workload names its micro-batch;
* :func:`batch_curve`: at each of :data:`CURVE_TOKENS` tokens per optimizer step, ZenFlow and
  the fastest peer that fits (each at its own micro-batch), and the speed-up;
* :func:`curve_table` and :func:`plot_curves`: the same for people.

Both offloaders hide the host's AdamW once a step's compute exceeds it, so the speed-up is a
curve over the batch, never one figure (docs/stepmodel.md, "At the batch you train with").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .inputs import MODES, Hardware, StepModelError, zenflow_config
from .workload import Workload
from .step import fitting_zenflow, memory_fits, predict
from .timeline import Prediction

MICRO_BATCH_CAP = 4096
"""The largest micro-batch (tokens) chosen for the user: beyond it a larger micro-batch
buys little arithmetic intensity and costs activation memory."""
MIN_MICRO_BATCH = 256
"""The smallest micro-batch tried (tokens) before a mode is called too big for the card."""
CURVE_TOKENS = (4096, 16384, 65536, 262144)
"""Tokens per optimizer step of the verdict curve: a short step, and the 16k-256k of the
fine-tunes users run (a global batch of 8-128 sequences of 2048)."""
PEERS = tuple(m for m in MODES if m != "zenflow")
"""Every mode but ZenFlow: AdamW on the device (where it fits, nothing beats it), and the
offloaders."""


def micro_batch_choices(tokens: int) -> list[int]:
    """The micro-batches tried for a step of ``tokens``, largest first: ``min(tokens,
    MICRO_BATCH_CAP)`` halved while at least :data:`MIN_MICRO_BATCH` (the step itself when
    it is smaller)."""
    m, out = min(tokens, MICRO_BATCH_CAP), []
    while True:
        out.append(m)
        if m // 2 < MIN_MICRO_BATCH:
            return out
        m //= 2


def predict_fitting(hw: Hardware, wl: Workload, mode: str, **kw: Any) -> Prediction:
    """:func:`~.step.predict` at the workload's micro-batch if it names one, else at the
    largest of :func:`micro_batch_choices` that fits the device and host (when none does:
    the largest that fits the device, whose prediction says what the host lacks, else the
    smallest's), each counting the activations with the
    workload's ``loss`` (``"chunked"``: one chunk of logits, so a larger micro-batch may fit
    than with the fp32 ``"logits"``). The prediction's ``micro_batch_tokens`` and
    ``micro_batches`` say which."""
    if wl.micro_batch_tokens is not None:
        return predict(hw, wl, mode, **kw)
    choices = [wl.replace(micro_batch_tokens=m) for m in micro_batch_choices(wl.tokens)]
    fitting = (w for w in choices if memory_fits(hw, w, mode, **kw))
    on_device = (w for w in choices if memory_fits(hw, w, mode, device_only=True, **kw))
    return predict(hw, next(fitting, None) or next(on_device, choices[-1]), mode, **kw)


def fitting_zenflow_at_batch(hw: Hardware, wl: Workload, **kw: Any) -> Prediction | None:
    """The leaner ZenFlow setting that fits (:func:`~.step.fitting_zenflow`) at the largest
    micro-batch where one does (the workload's own, if it names one), or None."""
    sizes = ([wl.micro_batch_tokens] if wl.micro_batch_tokens is not None
             else micro_batch_choices(wl.tokens))
    for m in sizes:
        p = fitting_zenflow(hw, wl.replace(micro_batch_tokens=m), **kw)
        if p is not None:
            return p
    return None


@dataclass(frozen=True)
class BatchPoint:
    """ZenFlow and its fastest peer at one number of tokens per optimizer step."""

    tokens: int
    zenflow: Prediction
    peer: str | None                 # the fastest peer that fits; None: none does
    peer_prediction: Prediction | None

    @property
    def speedup(self) -> float | None:
        """The peer's step time over ZenFlow's (> 1: ZenFlow is faster); None where either
        does not fit."""
        if self.peer_prediction is None or not self.zenflow.fits:
            return None
        return self.peer_prediction.step_time_s / self.zenflow.step_time_s


def batch_curve(hw: Hardware, wl: Workload, *, config: Any = None,
                tokens: Sequence[int] = CURVE_TOKENS, gpus: int = 1, sharding: str = "ddp",
                resident_fraction: float | None = None,
                peers: Sequence[str] = PEERS, lean: bool = False) -> list[BatchPoint]:
    """At each of ``tokens`` per optimizer step (per GPU), ZenFlow at ``config`` and every
    peer, each at the largest micro-batch that fits (:func:`predict_fitting`), and the
    fastest peer that fits. ``lean``: where ZenFlow at ``config`` fits no micro-batch, the
    leaner setting that fits (:func:`fitting_zenflow_at_batch`; its ``settings`` say which)."""
    cfg = zenflow_config(config)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise StepModelError(f"unknown peers {unknown}; peers: {', '.join(PEERS)}")
    points = []
    for t in tokens:
        w = wl.replace(tokens=int(t), micro_batch_tokens=None)
        kw = dict(gpus=gpus, config=cfg, sharding=sharding)
        zen = predict_fitting(hw, w, "zenflow", **kw)
        if lean and not zen.fits:
            zen = fitting_zenflow_at_batch(hw, w, **kw) or zen
        fit = {}
        for m in peers:
            p = predict_fitting(hw, w, m, resident_fraction=resident_fraction, **kw)
            if p.fits:
                fit[m] = p
        best = min(fit, key=lambda m: fit[m].step_time_s, default=None)
        points.append(BatchPoint(int(t), zen, best, fit.get(best)))
    return points


def _tokens(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def _at(p: Prediction) -> str:
    return (f"{p.step_time_s:.2f} s ({p.micro_batches} x {p.micro_batch_tokens})" if p.fits
            else "does not fit")


def curve_table(points: Sequence[BatchPoint]) -> str:
    """A markdown table: tokens per step, ZenFlow's step (micro-batches x tokens), the
    fastest peer's, and ZenFlow's speed-up over it."""
    lines = ["| tokens per step | zenflow (s, micro-batches) | fastest peer that fits | "
             "peer (s, micro-batches) | zenflow's speed-up |",
             "| --- | --- | --- | --- | --- |"]
    for pt in points:
        peer = pt.peer_prediction
        sp = pt.speedup
        lines.append(f"| {_tokens(pt.tokens)} | {_at(pt.zenflow)} | {pt.peer or 'none'} | "
                     f"{_at(peer) if peer else '-'} | "
                     f"{f'{sp:.2f}x' if sp is not None else '-'} |")
    return "\n".join(lines)


def verdict(points: Sequence[BatchPoint], threshold: float = 1.05) -> str:
    """One sentence: where ZenFlow is faster than its fastest peer by at least
    ``threshold`` and where it is not."""
    wins = [_tokens(p.tokens) for p in points if p.speedup and p.speedup >= threshold]
    even = [_tokens(p.tokens) for p in points if p.speedup and 1 / threshold < p.speedup
            < threshold]
    loses = [_tokens(p.tokens) for p in points if p.speedup and p.speedup <= 1 / threshold]
    alone = [_tokens(p.tokens) for p in points if p.zenflow.fits and p.peer is None]
    parts = []
    if wins:
        parts.append(f"faster than every peer at {', '.join(wins)} tokens per step")
    if alone:
        parts.append(f"the only mode that fits at {', '.join(alone)}")
    if even:
        parts.append(f"within {threshold - 1:.0%} of the fastest peer at {', '.join(even)}")
    if loses:
        parts.append(f"slower than the fastest peer at {', '.join(loses)}")
    if not parts:
        return "ZenFlow does not fit at any of these batches."
    return "ZenFlow is " + "; ".join(parts) + "."


def plot_curves(curves: Mapping[str, Sequence[BatchPoint]], path: str | os.PathLike[str],
                title: str | None = None) -> Path:
    """ZenFlow's speed-up over its fastest peer against tokens per optimizer step, one line
    per label (a card, a model); writes a PNG. Needs matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise StepModelError("plotting needs matplotlib: pip install matplotlib "
                             "(or pip install 'zenflow-triton[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        xs = [p.tokens for p in points if p.speedup is not None]
        ys = [p.speedup for p in points if p.speedup is not None]
        ax.plot(xs, ys, marker="o", label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per optimizer step (per GPU)")
    ax.set_ylabel("ZenFlow's speed-up over the fastest peer")
    ax.set_title(title or "ZenFlow against its fastest peer, by batch (model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
