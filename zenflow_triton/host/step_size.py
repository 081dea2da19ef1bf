"""The adaptive host step size (``host_lr_scale="adaptive"``): how far one host AdamW step on
a window-mean gradient should travel, estimated from the param's own host moments.

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

import numpy as np
import torch

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


def _fraction(sum_m2: float, sum_v: float, count: float, steps: int, beta1: float,
              beta2: float) -> float:
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


def signal_fraction(m: torch.Tensor, v: torch.Tensor, steps: int, beta1: float,
                    beta2: float) -> float:
    """``rho`` in [0, 1] of a param's host half whose moments ``m``, ``v`` hold ``steps``
    host steps (0 when ``steps < 2``: too little history to tell signal from noise)."""
    if steps < 2 or m.numel() == 0:
        return 0.0
    ms, vs = _sample(m), _sample(v)
    return _fraction(float(np.sum(ms * ms)), float(np.sum(vs)), ms.size, steps, beta1, beta2)


def multiplier(n: int, rho: float) -> float:
    """The host lr multiplier of a window of ``n`` gradients whose mean has signal fraction
    ``rho``: ``n / sqrt(rho + n (1 - rho))``, from ``sqrt(n)`` (noise) to ``n`` (signal)."""
    if n <= 1:
        return 1.0
    rho = min(1.0, max(0.0, rho))
    return n / math.sqrt(rho + n * (1.0 - rho))


def _cap(sum_w2: float, count: float, lr: float) -> float:
    if not lr > 0.0:
        return math.inf
    rms = math.sqrt(sum_w2 / count) if count else 0.0
    return max(1.0, TRUST * rms / lr)


def trust_cap(master: torch.Tensor, lr: float) -> float:
    """The largest multiplier whose host step changes the param's host half by at most
    ``TRUST`` of its RMS: an Adam step moves an element by about ``lr``, so a step of
    multiplier ``c`` by about ``c * lr``; never below 1 (one ordinary AdamW step)."""
    w = _sample(master)
    return _cap(float(np.dot(w, w)), w.size, lr)


def multiplier_of_sums(sums, n: int, step: int, beta1: float, beta2: float,
                       lr: float) -> float:
    """:func:`adaptive_multiplier` from a host half's :func:`sample_sums` (summed over its
    parts: every rank's rows under data parallelism)."""
    sum_m2, sum_v, sum_w2, count = (float(x) for x in sums)
    rho = _fraction(sum_m2, sum_v, count, step - 1, beta1, beta2)
    return min(multiplier(n, rho), _cap(sum_w2, count, lr))


def adaptive_multiplier(master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, n: int,
                        step: int, beta1: float, beta2: float, lr: float) -> float:
    """The multiplier of host step ``step`` (1-based) on a window of ``n`` gradients at base
    learning rate ``lr``, from the master and moments as they are before it (``step - 1``
    steps): the drift-matching multiplier, at most :func:`trust_cap`."""
    return multiplier_of_sums(sample_sums(master, m, v), n, step, beta1, beta2, lr)
