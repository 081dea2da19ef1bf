"""Does a model suit ZenFlow? The two gradient properties it relies on, measured per layer.

ZenFlow updates the top ``topk_ratio`` columns of each weight matrix on the device every step
and defers the rest. That costs little when

1. **the gradient energy is concentrated**: the top-k columns (by the same score the
   optimizer uses, the sum of g² per column) carry most of the squared gradient; and
2. **the top-k set is stable**: the columns chosen at one step are mostly the ones chosen
   at the next (and a few steps later), so a selection refreshed every ``select_interval``
   steps stays right in between.

:class:`GradientDiagnostics` records both after each backward pass, for every matrix param
the optimizer would split (``dim >= 2`` and at least ``min_offload_numel`` elements):

* ``energy_share``: sum of the top-k column scores / sum of all column scores (k/cols for
  gradient energy spread evenly, 1 for all of it in k columns);
* ``overlap_prev``: |top-k now ∩ top-k at the previous recorded step| / k;
* ``overlap_first``: the same against the first recorded step (drift over the run).

``zenflow-tune diagnose`` trains a workload with ``torch.optim.AdamW`` and records them,
writing a table, a JSON file and a PNG.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .config import DEFAULT_MIN_OFFLOAD_NUMEL
from .columns.selection import num_selected, select_columns
from .columns.spread import SPREAD_SHARE, TRAVEL_LIMIT
from .kernels import TORCH_OPS
from .columns.layout import view2d


@dataclass
class LayerRecord:
    name: str
    shape: tuple[int, ...]
    k: int
    cols: int
    energy_share: list[float] = field(default_factory=list)
    overlap_prev: list[float] = field(default_factory=list)
    overlap_first: list[float] = field(default_factory=list)

    def mean(self, what: str) -> float:
        values = getattr(self, what)
        return sum(values) / len(values) if values else float("nan")


class GradientDiagnostics:
    """Records, at each :meth:`record` call (after ``backward()``), how concentrated each
    matrix param's gradient energy is in its top-k columns and how stable that set is."""

    def __init__(self, named_params: Iterable, topk_ratio: float = 0.1, score: str = "l2",
                 min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL) -> None:
        if not 0.0 < topk_ratio < 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1), got {topk_ratio}")
        if score not in ("l2", "l1"):
            raise ValueError(f"score must be 'l2' or 'l1', got {score!r}")
        self.topk_ratio = topk_ratio
        self.score = score
        self._params = []
        self.layers: list[LayerRecord] = []
        for i, item in enumerate(named_params):
            name, p = item if isinstance(item, tuple) else (f"param{i}", item)
            if not p.requires_grad or p.dim() < 2 or p.numel() < min_offload_numel:
                continue
            cols = p.numel() // p.shape[0]
            self._params.append(p)
            self.layers.append(LayerRecord(name, tuple(p.shape), num_selected(cols, topk_ratio),
                                           cols))
        if not self.layers:
            raise ValueError("no matrix param to diagnose (dim >= 2 and at least "
                             f"min_offload_numel={min_offload_numel} elements)")
        self._first: list[torch.Tensor | None] = [None] * len(self.layers)
        self._prev: list[torch.Tensor | None] = [None] * len(self.layers)
        self.steps = 0

    @torch.no_grad()
    def record(self) -> None:
        """Read every diagnosed param's ``.grad`` (a param without one is skipped)."""
        for i, (p, layer) in enumerate(zip(self._params, self.layers)):
            if p.grad is None:
                continue
            # The optimizer's own rule: its column score, its pick (ties to the lower index).
            scores = TORCH_OPS.column_scores(view2d(p.grad), self.score)
            total = scores.sum().item()
            top = select_columns(scores, layer.k)
            layer.energy_share.append(scores[top].sum().item() / total if total > 0 else 0.0)
            chosen = torch.zeros(layer.cols, dtype=torch.bool, device=scores.device)
            chosen[top] = True
            if self._prev[i] is not None:
                layer.overlap_prev.append((chosen & self._prev[i]).sum().item() / layer.k)
                layer.overlap_first.append((chosen & self._first[i]).sum().item() / layer.k)
            else:
                self._first[i] = chosen
            self._prev[i] = chosen
        self.steps += 1

    # ------------------------------------------------------------------ reports
    def summary(self) -> dict:
        """Per layer the means over the recorded steps, and the element-weighted means over
        all layers (``overall``)."""
        rows = []
        weights = []
        for layer in self.layers:
            rows.append(dict(name=layer.name, shape=list(layer.shape), k=layer.k,
                             cols=layer.cols, energy_share=layer.mean("energy_share"),
                             overlap_prev=layer.mean("overlap_prev"),
                             overlap_first=layer.mean("overlap_first")))
            weights.append(int(torch.Size(layer.shape).numel()))

        def weighted(key):
            pairs = [(r[key], w) for r, w in zip(rows, weights) if r[key] == r[key]]
            total = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / total if total else float("nan")

        return dict(topk_ratio=self.topk_ratio, score=self.score, steps=self.steps,
                    layers=rows,
                    overall=dict(energy_share=weighted("energy_share"),
                                 overlap_prev=weighted("overlap_prev"),
                                 overlap_first=weighted("overlap_first"),
                                 uniform_share=self.topk_ratio))

    def table(self, max_rows: int | None = None) -> str:
        s = self.summary()
        lines = [f"top {s['topk_ratio']:.0%} of columns by {s['score']} score, {s['steps']} "
                 "steps", "| layer | shape | energy in top-k | overlap with previous step | "
                 "overlap with first step |", "| --- | --- | --- | --- | --- |"]
        rows = s["layers"] if max_rows is None else s["layers"][:max_rows]
        for r in rows:
            lines.append(f"| {r['name']} | {'x'.join(map(str, r['shape']))} | "
                         f"{r['energy_share']:.3f} | {r['overlap_prev']:.3f} | "
                         f"{r['overlap_first']:.3f} |")
        if max_rows is not None and len(s["layers"]) > max_rows:
            lines.append(f"| ... {len(s['layers']) - max_rows} more | | | | |")
        o = s["overall"]
        lines.append(f"| **all (element-weighted)** | | {o['energy_share']:.3f} | "
                     f"{o['overlap_prev']:.3f} | {o['overlap_first']:.3f} |")
        return "\n".join(lines)

    def to_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.summary(), f, indent=1)

    def plot(self, path, title: str = "") -> None:
        """A PNG of :meth:`summary` (see :func:`plot_summary`). Needs matplotlib."""
        plot_summary(self.summary(), path, title)


def kind_table(s: dict) -> str:
    """A :meth:`GradientDiagnostics.summary` grouped by kind of layer (the name with its
    layer numbers taken out, e.g. ``model.layers.N.self_attn.q_proj.weight``): the means
    over the layers of each kind, in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in s["layers"]:
        groups.setdefault(re.sub(r"\.\d+(?=\.)", ".N", r["name"]), []).append(r)
    lines = ["| layers | count | energy in top-k (mean, min-max) | overlap with previous step "
             "(mean) |", "| --- | --- | --- | --- |"]
    for kind, rows in groups.items():
        shares = [r["energy_share"] for r in rows]
        overlaps = [r["overlap_prev"] for r in rows]
        lines.append(f"| {kind} | {len(rows)} | {sum(shares) / len(rows):.2f} "
                     f"({min(shares):.2f}-{max(shares):.2f}) | "
                     f"{sum(overlaps) / len(rows):.2f} |")
    return "\n".join(lines)


VERDICT_TOPK = 0.1
"""The verdict's thresholds were measured at this ``topk_ratio`` (``bench/convergence/
energy.py``: the share of gradient energy in the top 10% of columns over the first 12
AdamW steps, beside the defaults' measured gap to AdamW): SmolLM2-135M 0.63 (the defaults
0.003 nats behind AdamW), all-MiniLM-L6-v2 classifiers 0.34-0.37 (from 0.014 nats ahead on
BBC News to 0.015 behind on noisy tweets). Two model families: evidence, not a law."""


def verdict(s: dict, travel: float | None = None) -> str:
    """One line from a :meth:`GradientDiagnostics.summary`: does the model suit ZenFlow, and
    which settings to train it with (thresholds: :data:`VERDICT_TOPK`, and
    ``columns.spread.SPREAD_SHARE``, the same line ``fresh_if_spread`` draws). ``travel``:
    the window travel at the lr the user trains at (``columns.spread.window_travel``); over
    ``TRAVEL_LIMIT`` on a concentrated gradient the verdict says a window may be stale and
    names the fresh schedule to compare with (the optimizer's warning, in one line)."""
    o = s["overall"]
    share, overlap = o["energy_share"], o["overlap_prev"]
    if abs(s["topk_ratio"] - VERDICT_TOPK) > 1e-9:
        return (f"verdict: measured at topk_ratio={VERDICT_TOPK} only; rerun with "
                f"--topk-ratio {VERDICT_TOPK}")
    unstable = (f"; the top set changes from step to step (overlap {overlap:.2f})"
                if overlap == overlap and overlap < 0.4 else "")
    far = travel is not None and travel > TRAVEL_LIMIT
    window = ("" if travel is None else
              f"; a window travels {travel:.1e} (update_interval x lr / the split weights' RMS, "
              + (f"over {TRAVEL_LIMIT:g})" if far else f"under {TRAVEL_LIMIT:g})"))
    fresh = ("host_betas='window' with apply_delay=1 (what the defaults switch to on a spread "
             "gradient, fresh_if_spread; within about 0.01 nats of AdamW on the study's spread "
             "workloads, for delay 1's step time): keep it, and do not train this model with a "
             "profile's or config's host_betas='step' with a longer apply delay (up to 0.034 "
             "nats and 2.6 points behind AdamW there; docs/quality.md, 'Spread gradients')")
    if share >= SPREAD_SHARE and far:
        return (f"verdict: suits ZenFlow, but a window may be stale at this lr ({share:.2f} of "
                f"the gradient energy in the top 10% of columns{window}: at such a travel the "
                "default schedule ended 0.034 nats behind AdamW on Gemma 3 270M and 0.008 "
                "ahead on SmolLM2-135M at lr 1e-4; docs/quality.md, 'The window's travel'): "
                "where final quality matters more than step time, compare the defaults with "
                f"host_betas='window', apply_delay=1 on your data{unstable}")
    if share >= SPREAD_SHARE:
        return (f"verdict: suits ZenFlow ({share:.2f} of the gradient energy in the top 10% "
                "of columns, like SmolLM2's 0.58-0.63 where the defaults end within 0.003 nats "
                f"of AdamW{window}): start from the defaults or a tuned profile{unstable}")
    if share >= 0.3:
        return (f"verdict: spread, suits ZenFlow with care ({share:.2f} of the energy in the top "
                f"10%, under {SPREAD_SHARE}, like the encoder classifiers' 0.27-0.44{window}): "
                f"train with {fresh}{unstable}")
    return (f"verdict: may not suit ZenFlow ({share:.2f} of the energy in the top 10%, near "
            f"uniform; no measured workload is this low{window}): tune on your data with a "
            f"higher topk_ratio (0.2-0.3) before relying on it, and train with {fresh}"
            f"{unstable}")


def plot_summary(s: dict, path, title: str = "") -> None:
    """A PNG of a :meth:`GradientDiagnostics.summary` (or its JSON): per matrix param in
    model order, the energy share of the top-k columns (against the uniform share k/cols)
    and the overlap of consecutive top-k sets. Needs matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = s["layers"]
    x = range(len(layers))
    fig, ax = plt.subplots(figsize=(min(11.0, max(6.0, 0.06 * len(layers) + 4)), 4.2))
    ax.plot(x, [r["energy_share"] for r in layers], ".-", lw=0.8, ms=3,
            label="gradient energy in the top-k columns")
    ax.plot(x, [r["overlap_prev"] for r in layers], ".-", lw=0.8, ms=3,
            label="top-k overlap with the previous step")
    ax.axhline(s["topk_ratio"], color="grey", lw=0.8, ls="--",
               label=f"uniform share: {s['topk_ratio']:.0%}")
    o = s["overall"]
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("matrix param, in model order")
    ax.set_ylabel("fraction")
    ax.set_title((title or "gradient concentration and top-k stability")
                 + f"\nall layers (element-weighted): energy {o['energy_share']:.2f}, "
                   f"overlap {o['overlap_prev']:.2f}, {s['steps']} steps", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
