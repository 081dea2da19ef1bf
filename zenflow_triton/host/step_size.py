"""The host step size: the learning-rate multiplier of one host AdamW step on the mean of a
window of ``n`` gradients (``ZenFlowConfig.host_lr_scale``). Every rule lives here, behind two
calls: :func:`window_lr` when a window closes (the fixed rules: 1, n, min(sqrt(n), cap), a
number) and :func:`resolve_adaptive` in the host job, when the moments are final (the
adaptive rule below).

The adaptive rule (``host_lr_scale="adaptive"``): how far one host AdamW step on a
window-mean gradient should travel, estimated from the param's own host moments.

A host-owned column gets one Adam step per window of ``n`` gradients. Per element, with
gradients ``g_t = mu + noise`` (noise variance ``s2``), AdamW's ``n`` steps drift by about
``n * lr * mu / sqrt(mu^2 + s2)``; one host step on the window mean (noise ``s2 / n``)
drifts by ``c * lr * mu / sqrt(mu^2 + s2 / n)``. They agree when

    c = n / sqrt(rho + n * (1 - rho)),   rho = mu^2 / (mu^2 + s2 / n),

the signal fraction of the window mean: ``c = n`` for a steady gradient (``rho = 1``),
``c = sqrt(n)`` for pure noise (``rho = 0``), and ``sqrt(n) <= c <= n`` between, so a window
never travels farther than ``n`` AdamW steps could. ``n = 1`` gives ``c = 1`` whatever
``rho``: plain AdamW.

``rho`` comes from the host moments the param already has, before this window's update
(``k - 1`` host steps): the bias-corrected ``m_hat^2`` overestimates ``mu^2`` by the EMA's
own noise, ``f * s2/n`` with ``f = (1 - b1)(1 + b1^j) / ((1 + b1)(1 - b1^j))`` after ``j``
steps, and ``v_hat`` estimates ``mu^2 + s2/n``; so ``rho = (R - f) / (1 - f)``, clamped to
[0, 1], with ``R = sum m_hat^2 / sum v_hat`` over the param's host half (a fixed strided
sample of at most ``SAMPLE`` elements, summed in float64 by numpy: deterministic whatever
the threads). With no history (``j < 2``) the estimate assumes noise: ``c = sqrt(n)``.

Drift matching assumes the window's gradients would not have changed had the param moved
during the window; that fails when one stale step is large against the weights (the tiny
LMs at lr 1e-3, near the edge of stability, diverged at long windows with ``c`` near ``n``).
So ``c`` is also capped where one host step would change the host half by more than
``TRUST`` of its RMS (``c * lr > TRUST * rms(w)``), never below 1: ZenFlow's one ordinary
step. The derivation is in docs/design.md, "The host step size".
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Hashable, Sequence

import numpy as np
import torch

SQRT_SCALE_CAP = 2.0
"""``host_lr_scale="sqrt"`` gives min(sqrt(n), SQRT_SCALE_CAP): sqrt of the default
update_interval. Uncapped, sqrt(16) = 4 diverged once in the step-size study
(docs/quality.md)."""

SAMPLE = 1 << 16
"""Most elements of a param's host moments (or master) read for one estimate."""

TRUST = 0.01
"""Most relative change (of the host half's RMS) one adaptive host step may make; set a
priori, not fitted: about ten fine-tuning AdamW steps (lr 2e-5 on weights of RMS 0.03 move
them 0.07% a step)."""


SUMS = 4
"""The statistics one estimate reads: sum of ``m^2``, sum of ``v``, sum of ``w^2``, and how
many elements were sampled; sums over parts of a host half (a rank's rows) add up."""


def _sample(t: torch.Tensor, offset: int = 0, total: int | None = None) -> np.ndarray:
    """The sampled elements of ``t`` (float64): every ``stride``-th element of a flat host
    half of ``total`` elements (``t`` itself by default), of which ``t`` holds the
    ``t.numel()`` from ``offset`` on (a rank's rows); so the parts of a host half sample
    exactly the elements the whole would."""
    flat = t.reshape(-1)
    total = flat.numel() if total is None else total
    stride = (total // SAMPLE) | 1 if total > SAMPLE else 1  # odd: spreads over the columns
    if stride > 1 or offset:
        flat = flat[(-offset) % stride::stride]
    return flat.to(torch.float32).numpy().astype(np.float64)


def sample_sums(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, offset: int = 0,
                total: int | None = None) -> np.ndarray:
    """The :data:`SUMS` statistics (float64) of the sampled elements of a host half's master
    and moments, or of its part from flat element ``offset`` on (of ``total``): a rank's
    rows; the parts' sums add up to the whole's, to float64 rounding."""
    ms, vs, ws = (_sample(t, offset, total) for t in (m, v, master))
    return np.array([np.sum(ms * ms), np.sum(vs), np.dot(ws, ws), ws.size], dtype=np.float64)


def fraction_of_sums(sums, steps: int, beta1: float, beta2: float) -> float:
    """``rho`` in [0, 1] of a host half whose moments hold ``steps`` host steps, from its
    :func:`sample_sums` (0 when ``steps < 2``: too little history to tell signal from noise)."""
    sum_m2, sum_v, _, count = (float(x) for x in sums)
    if steps < 2 or count == 0:
        return 0.0
    bc1 = 1.0 - beta1 ** steps
    bc2 = 1.0 - beta2 ** steps
    den = sum_v / bc2
    if not den > 0.0 or not math.isfinite(den):
        return 0.0
    ratio = sum_m2 / (bc1 * bc1) / den
    f = (1.0 - beta1) * (1.0 + beta1 ** steps) / ((1.0 + beta1) * bc1)
    if f >= 1.0:
        return 0.0
    rho = (ratio - f) / (1.0 - f)
    return min(1.0, max(0.0, rho)) if math.isfinite(rho) else 0.0




def multiplier(n: int, rho: float) -> float:
    """The host lr multiplier of a window of ``n`` gradients whose mean has signal fraction
    ``rho``: ``n / sqrt(rho + n (1 - rho))``, from ``sqrt(n)`` (noise) to ``n`` (signal)."""
    if n <= 1:
        return 1.0
    rho = min(1.0, max(0.0, rho))
    return n / math.sqrt(rho + n * (1.0 - rho))


def cap_of_sums(sums, lr: float) -> float:
    """The largest multiplier whose host step changes the host half by at most ``TRUST`` of
    its RMS (from its :func:`sample_sums`): an Adam step moves an element by about ``lr``, so
    a step of multiplier ``c`` by about ``c * lr``; never below 1 (one ordinary AdamW step)."""
    _, _, sum_w2, count = (float(x) for x in sums)
    if not lr > 0.0:
        return math.inf
    rms = math.sqrt(sum_w2 / count) if count else 0.0
    return max(1.0, TRUST * rms / lr)




def multiplier_of_sums(sums, n: int, step: int, beta1: float, beta2: float,
                       lr: float) -> float:
    """The multiplier of host step ``step`` (1-based) on a window of ``n`` gradients at base
    learning rate ``lr``, from a host half's :func:`sample_sums` as it is before the step
    (summed over its parts: every rank's rows under data parallelism): the drift-matching
    multiplier, at most :func:`cap_of_sums`."""
    rho = fraction_of_sums(sums, step - 1, beta1, beta2)
    return min(multiplier(n, rho), cap_of_sums(sums, lr))




def fixed_multiplier(scale, n: int, warmup: bool = False) -> float:
    """The multiplier a window of ``n`` gradients gets when it closes: 1 in warm-up (plain
    AdamW) and under "adaptive" (the job multiplies by :func:`resolve_adaptive`'s), n under
    "auto", min(sqrt(n), SQRT_SCALE_CAP) under "sqrt", else the number ``scale``."""
    if warmup or scale == "adaptive":
        return 1.0
    if scale == "auto":
        return float(n)
    if scale == "sqrt":
        return min(math.sqrt(n), SQRT_SCALE_CAP)
    return float(scale)


def window_lr(scale, lr: float, n: int, warmup: bool) -> tuple[float, int]:
    """``(lr, adaptive_window)`` of a window of ``n`` gradients closing at base learning rate
    ``lr``: lr times :func:`fixed_multiplier`, and ``n`` where the host job resolves the
    multiplier itself (the adaptive rule on a window of more than one gradient after warm-up;
    see :func:`resolve_adaptive`), else 0."""
    adaptive = n if scale == "adaptive" and not warmup and n > 1 else 0
    return lr * fixed_multiplier(scale, n, warmup), adaptive


def resolve_adaptive(tasks: list, keys: Sequence[Hashable]) -> tuple[list, dict[Hashable, float]]:
    """``tasks`` (``host.adamw.HostTask``) with every adaptive learning rate resolved
    (``HostHyper.adaptive_window``): lr times the multiplier that the task's moments give (or
    its ``adaptive_sums``, summed over the ranks); and those multipliers by key. Called by the
    host job once the moments are final (the job before has finished)."""
    out, record = [], {}
    for key, task in zip(keys, tasks):
        h = task.hyper
        if h.adaptive_window:
            sums = h.adaptive_sums
            if sums is None:
                sums = sample_sums(task.master, task.m, task.v)
            c = multiplier_of_sums(sums, h.adaptive_window, h.step, h.beta1, h.beta2, h.lr)
            record[key] = c
            task = task._replace(hyper=replace(h, lr=h.lr * c, adaptive_window=0,
                                               adaptive_sums=None))
        out.append(task)
    return out, record
