"""Is the gradient spread over the columns, and does a window travel far? Measured once, at
a run's first selection, from the same column scores the selection ranks (``plan_selection``
hands each matrix's scores to :meth:`Spread.measure`) and the split matrices' weights
(:meth:`Spread.weigh`). A spread gradient is acted on by ``ZenFlowConfig.fresh_if_spread``;
a far window under a stale schedule is warned about.

The window travel: ``update_interval`` x the lr / the split matrices' weight RMS, how far a
window's steps move the weights against their size (Adam's step is about the lr per element,
whatever the gradient's scale). A stale schedule applies a window's result computed from
gradients the weights have since moved away from; over :data:`TRAVEL_LIMIT` the gradient has
turned enough within a window for that to cost quality (``bench/convergence/drift.py``:
on a fixed batch, Gemma 3 270M's gradient at lr 2e-5 keeps a cosine of 0.72 to its value
four steps earlier, SmolLM2-135M's 0.99), though not always: see :data:`TRAVEL_LIMIT`.

The number: for each matrix of the model (every param of 2 or more dims and at least
``min_offload_numel`` elements: the split ones and those the dense set keeps whole, as
``zenflow-tune diagnose`` counts them), the share of its column scores (the sum of g² per
column under the default ``score="l2"``) in its top :data:`SPREAD_TOPK` of columns, whatever
the run's own ``topk_ratio``; the element-weighted mean over the matrices. On the
convergence study's first step the LMs (SmolLM2-135M, Gemma 3 270M) give 0.57-0.64, and the
default schedule stays within 0.003 nats of AdamW on SmolLM2 (not on Gemma: +0.034, a
loss this measure does not flag, the window travel does); the encoder classifiers give
0.27-0.44 (MiniLM-L6, its 3-layer cut, the 12-layer all-mpnet-base-v2), and there it lagged
AdamW by up to 0.034 nats and 2.6 points where ``host_betas="window"`` with ``apply_delay=1``
stayed within about 0.011 nats (docs/quality.md, "Spread gradients"). Below
:data:`SPREAD_SHARE` the run is "spread". It is a correlate measured on four models (two
encoder and two decoder families), not the mechanism: the embeddings, the largest
matrices, carry most of the difference (the split matrices alone give 0.46-0.57 against
SmolLM2's 0.55-0.59: bench/convergence/energy.py).

What it costs, once per run: the column scores of the whole matrices (the split ones are
scored for the selection anyway), the top-k of each matrix's scores and two sums, on the
scores' device, and one copy of two numbers per matrix to the host. Every rank of a data-parallel
run measures the same scores (DDP averages the gradients; FSDP2's ranks sum theirs before
the selection), weights each matrix by its whole size, and so decides alike.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable

import numpy as np
import torch

from ..config import ZenFlowConfig
from .selection import num_selected

SPREAD_TOPK = 0.1
"""The share of each matrix's columns whose score share is measured (the study's 10%)."""
SPREAD_SHARE = 0.5
"""Below this share of the squared gradient in the top 10% of columns, a run is spread."""
TRAVEL_LIMIT = 1e-3
"""Above this window travel (``update_interval`` x lr / the split matrices' weight RMS) a
stale schedule's window may be too long for the run's learning rate, and is warned about:
SmolLM2-135M at lr 2e-5 travels 4.1e-4 a window of 4 (the default schedule within 0.003 nats
of AdamW), Gemma 3 270M at 2e-5 2.3e-3 (its weights' RMS is 0.034 against SmolLM2's 0.193;
the default schedule 0.034 nats behind AdamW, the fresh pair 0.012), SmolLM2 at 1e-4 2.1e-3
(the default schedule 0.008 ahead, the fresh pair 0.020 behind: so a far window alone does
not switch the schedule). docs/quality.md, "The window's travel"; bench/convergence/drift.py.
Two decoders: evidence, not a law."""

log = logging.getLogger("zenflow_triton")


def peak_lr(group: dict) -> float:
    """The learning rate a param group trains at: its ``lr``, or a scheduler's base where that
    is larger (``initial_lr``, which torch's schedulers set; ``max_lr``, OneCycleLR's and
    CyclicLR's peak): a first selection inside a warm-up sees a fraction of the peak."""
    values = [group.get(k) for k in ("lr", "initial_lr", "max_lr")]
    return max(float(v) for v in values if isinstance(v, (int, float, torch.Tensor)))


def window_travel(named_params, lr: float, update_interval: int = 4,
                  config: ZenFlowConfig | None = None) -> float | None:
    """The window travel of a model's weights as they are, outside an optimizer (``zenflow-tune
    diagnose``, the convergence scripts): ``update_interval`` x ``lr`` / the RMS of the
    matrices ``config`` (default: the defaults) would split (2 or more dims, at least
    ``min_offload_numel`` elements, not in the dense set by name); None without such a
    matrix. The optimizer measures the same at its first selection, from its groups' lrs."""
    from ..state import MATRIX, classify  # lazy: state imports this package

    config = config or ZenFlowConfig()
    sumsq = numel = 0
    for name, p in named_params:
        if classify(p, config, name) == MATRIX:
            sumsq += float(p.detach().double().pow(2).sum())
            numel += p.numel()
    if numel == 0 or sumsq <= 0:
        return None
    return update_interval * lr / float(np.sqrt(sumsq / numel))


def _outside() -> int:
    """The ``stacklevel`` of the first frame outside this library and torch (the user's
    ``opt.step()`` line, whatever wrappers torch puts around ``step``)."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "zenflow_triton", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def freshened(config: ZenFlowConfig) -> ZenFlowConfig | None:
    """The fresh schedule where ``fresh_if_spread`` may switch ``config`` to it (the stale
    default, ``apply_delay`` not given), else None: what a spread gradient trains with (the
    real-model quality store asks, to judge such a setting by both schedules)."""
    if config.fresh_if_spread and config.stale_default and config.apply_delay is None:
        return dataclasses.replace(config, host_betas="window", apply_delay=1)
    return None


NOT_SAVED = object()
"""What :meth:`Spread.restore` gets for a state dict without a ``spread`` entry."""


class Spread:
    """The first selection's measurement, the choice made from it, and what a checkpoint
    carries of both (:meth:`state` / :meth:`restore`)."""

    def __init__(self, link, owner_of: Callable[[torch.Tensor], torch.Tensor],
                 config: ZenFlowConfig) -> None:
        self.link = link
        self.owner_of = owner_of
        """The whole param of a local tensor (FSDP2), whose size weighs it."""
        self.base = config
        """The constructor's config (what :meth:`restore` starts from)."""
        self.share: float | None = None
        """The measured share (None before the first selection, or with nothing to rank)."""
        self.fresh: bool = False
        """Whether ``fresh_if_spread`` switched this run to the fresh schedule."""
        self.travel: float | None = None
        """The window travel at the first selection: ``update_interval`` x the lr (the
        element-weighted mean of the split matrices' groups' :func:`peak_lr`) / the split
        matrices' weight RMS (None before, or with no split matrix)."""
        self.settled = False
        """Measured, or resumed from a state dict written before this measure existed."""
        self._parts: list[tuple[int, torch.Tensor]] = []
        self._weights: list[tuple[int, float, torch.Tensor]] = []

    @property
    def pending(self) -> bool:
        """Nothing measured yet: the next selection's scores are wanted."""
        return not self.settled

    def begin(self) -> None:
        """A plan starts: what an earlier one kept is dropped."""
        self._parts = []
        self._weights = []

    def weigh(self, p: torch.Tensor, lr: float, sumsq: torch.Tensor) -> None:
        """One split matrix's squared weight norm (``sumsq``, a 1-element tensor summed over
        the ranks where its rows are split) and its group's :func:`peak_lr`, kept on the
        device until :meth:`settle`."""
        self._weights.append((self.owner_of(p).numel(), lr, sumsq.reshape(1).float()))

    def measure(self, p: torch.Tensor, scores: torch.Tensor) -> None:
        """One matrix's column scores (summed over the ranks where they are split): its top
        10% share, kept on the scores' device until :meth:`settle`."""
        k = num_selected(scores.numel(), SPREAD_TOPK)
        if k == 0:
            return
        s = scores.float()
        self._parts.append((self.owner_of(p).numel(), torch.stack([torch.topk(s, k).values.sum(),
                                                           s.sum()])))

    def settle(self, config: ZenFlowConfig) -> ZenFlowConfig:
        """After the first selection: the share from what :meth:`measure` kept and the
        window travel from what :meth:`weigh` kept (one copy to the host per device for
        both), and the config the run trains with from now on: the fresh schedule where the
        gradient is spread, ``fresh_if_spread`` is on and the config is the stale default;
        else ``config``. A stale schedule that stays on a spread gradient or a far window is
        warned about, once."""
        parts, self._parts = self._parts, []
        weights, self._weights = self._weights, []
        if not self.pending or not parts:
            return config
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, pair in parts:
            by_device.setdefault(pair.device, []).append(pair)
        for _, _, sumsq in weights:
            by_device.setdefault(sumsq.device, []).append(sumsq)
        host = {d: iter(self.link.to_host(torch.cat([t.float() for t in ts])).numpy()
                        .astype(np.float64).tolist()) for d, ts in by_device.items()}
        weight = total = 0.0
        for n, pair in parts:  # each device's values in the order they were appended
            top, whole = next(host[pair.device]), next(host[pair.device])
            if whole > 0 and np.isfinite(whole):
                weight += n
                total += n * top / whole
        numel = lr_sum = sumsq_sum = 0.0
        for n, lr, sumsq in weights:
            numel += n
            lr_sum += n * lr
            sumsq_sum += next(host[sumsq.device])
        if weight == 0:  # every gradient zero: nothing to go by, ask again next selection
            return config
        self.share = float(total / weight)
        rms = np.sqrt(sumsq_sum / numel) if numel else 0.0
        self.travel = (float(config.update_interval * (lr_sum / numel) / rms)
                       if rms > 0 and np.isfinite(rms) else None)
        self.settled = True
        return self.choose(config)

    @property
    def far(self) -> bool:
        """The window travel is over :data:`TRAVEL_LIMIT`."""
        return self.travel is not None and self.travel > TRAVEL_LIMIT

    def choose(self, config: ZenFlowConfig) -> ZenFlowConfig:
        """The config for the measured :attr:`share` (see :meth:`settle`); a far window under
        a stale schedule is warned about (the schedule stays: the evidence is split)."""
        spread = self.share < SPREAD_SHARE
        if not config.stale_default or not (spread or self.far):
            return config
        keeps = (f"this run keeps host_betas='step' with "
                 f"apply_delay={config.effective_apply_delay}")
        if not spread:
            warnings.warn(
                f"ZenFlowOptimizer: a window travels far ({self.travel:.1e}: update_interval x "
                f"lr / the split weights' RMS, over {TRAVEL_LIMIT:g}), so each host window's "
                "result may be stale when it is applied: at such a travel the default schedule "
                "ended 0.034 nats behind AdamW on Gemma 3 270M, and 0.008 ahead on "
                "SmolLM2-135M at lr 1e-4 (docs/quality.md, 'The window's travel'); "
                f"{keeps}. Where final quality matters more than step time, compare with "
                "host_betas='window', apply_delay=1",
                UserWarning, stacklevel=_outside())
            return config
        fresh = freshened(config)
        if fresh is not None:
            self.fresh = True
            log.info("the gradient is spread (%.2f of it in the top 10%% of "
                     "columns, under %.1f): training with host_betas='window', "
                     "apply_delay=1 (fresh_if_spread)", self.share, SPREAD_SHARE)
            return fresh
        warnings.warn(
            f"ZenFlowOptimizer: the gradient is spread ({self.share:.2f} of its squared norm in "
            f"the top 10% of each matrix's columns, under {SPREAD_SHARE}); on such fine-tunes "
            "the default schedule (host_betas='step', each window's result applied a window "
            "late) ended up to 0.034 nats and 2.6 accuracy points behind AdamW (docs/quality.md, "
            f"'Spread gradients'), and {keeps}. For AdamW's quality pass "
            "host_betas='window', apply_delay=1 (more "
            "step time where the host is what a step waits for), or leave apply_delay unset "
            "with fresh_if_spread=True; `zenflow-tune diagnose` measures it per layer",
            UserWarning, stacklevel=_outside())
        return config

    # ---- checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """For a state dict: one structure whether measured or not (DCP loads into the state
        dict of a fresh optimizer, keys for keys)."""
        return {"settled": self.settled,
                "share": float("nan") if self.share is None else self.share,
                "travel": float("nan") if self.travel is None else self.travel,
                "fresh": self.fresh}

    def restore(self, saved: Any) -> ZenFlowConfig:
        """A checkpoint's measurement and the config it implies for the constructor's,
        without a second warning. Not settled (or None): measure at the next selection;
        :data:`NOT_SAVED`: a state dict written before this measure existed, whose run goes
        on with the schedule as configured, unmeasured (and says so when saved again)."""
        config = self.base
        self._parts = []
        self.fresh = False
        self.share = self.travel = None
        self.settled = saved is NOT_SAVED
        if not isinstance(saved, dict) or not saved.get("settled"):
            return config
        self.settled = True
        share = float(saved.get("share", float("nan")))
        self.share = share if share == share else None
        travel = float(saved.get("travel", float("nan")))  # absent before it was measured
        self.travel = travel if travel == travel else None
        fresh = freshened(config) if saved.get("fresh") else None
        self.fresh = fresh is not None
        return config if fresh is None else fresh

    def stats(self) -> dict[str, Any]:
        return {"share": self.share, "spread": None if self.share is None
                else self.share < SPREAD_SHARE, "travel": self.travel,
                "far": None if self.share is None else self.far, "fresh": self.fresh}
