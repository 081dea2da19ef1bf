"""The measured objective: train a workload for N steps, time the steady state, and check the
held-out loss against full AdamW's (the quality guard).

* **Throughput** = items (tokens or samples) per second over steps ``skip_steps+1 .. steps``,
  ending after ``opt.synchronize()`` so host work still in flight is paid for. The first
  ``skip_steps`` steps (allocation, selection, thread start) are excluded.
* **Quality guard**: ``ref`` is the held-out loss of ``torch.optim.AdamW`` with the same
  hyperparameters, data and seed after the same number of steps (computed once per study).
  A trial is feasible iff ``heldout_loss <= ref + loss_margin * |ref|``: within
  ``loss_margin`` (default 2%) of AdamW's loss, i.e. "as good as AdamW" up to that margin.
  The violation ``heldout_loss - limit`` is the Optuna constraint (<= 0 is feasible). A run
  that diverges (non-finite loss) is infeasible. The held-out loss before training
  (``init``) is measured too: where the limit is not below it, the guard cannot tell
  training from not training, and the study says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import optuna
import torch

from .space import SearchSpace
from .training import Workload, build_workload, heldout_loss

__all__ = ["TuneSettings", "TrainResult", "train_and_measure", "measure_reference",
           "quality_limit", "guard_summary", "Objective", "DIVERGED_VIOLATION", "DEFAULT_LOSS_MARGIN"]

from .defaults import DEFAULT_LOSS_MARGIN, DEFAULT_LR  # noqa: E402  (re-exported)

MAX_LOSS_MARGIN = 1.0

DIVERGED_VIOLATION = 1e9
"""Constraint value recorded for a run whose loss went non-finite."""


@dataclass(frozen=True)
class TuneSettings:
    """Everything that defines the objective of a study (stored with it; a resumed study must
    use the same values, or its trials would not be comparable)."""

    workload: str = "tinylm"
    steps: int = 60
    skip_steps: int = 10
    seed: int = 0
    lr: float = DEFAULT_LR
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    loss_margin: float = DEFAULT_LOSS_MARGIN
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"steps must be >= 2, got {self.steps}")
        if not 0 <= self.skip_steps < self.steps:
            raise ValueError(f"skip_steps must be in [0, steps), got {self.skip_steps}")
        if not 0 <= self.loss_margin <= MAX_LOSS_MARGIN:
            raise ValueError(f"loss_margin must be in [0, {MAX_LOSS_MARGIN}], got "
                             f"{self.loss_margin}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneSettings":
        d = dict(d)
        d["betas"] = tuple(d.get("betas", (0.9, 0.999)))
        return cls(**d)


@dataclass
class TrainResult:
    throughput: float
    """Items per second over the measured steps (nan if diverged before measuring)."""
    heldout_loss: float
    final_train_loss: float
    diverged: bool
    measured_steps: int
    measured_seconds: float
    unit: str
    stats: dict[str, Any] = field(default_factory=dict)
    initial_loss: float | None = None
    throughput_halves: tuple[float, float] | None = None
    """Throughput over the first and the second half of the measured steps (None with fewer
    than 4 measured steps): apart by much, the machine was not steady."""


UNSTEADY = 1.25
"""The AdamW reference's throughput over the two halves of its run differing by more than
this factor is warned about (set a priori: one half a quarter faster than the other)."""


def quality_limit(reference_loss: float, loss_margin: float) -> float:
    """Largest feasible held-out loss: ``ref + loss_margin * |ref|`` (``ref * (1 + margin)``
    for a positive loss)."""
    return reference_loss + loss_margin * abs(reference_loss)


def guard_summary(reference: dict[str, Any], loss_margin: float) -> str:
    """The guard as a run prints it: ``AdamW reference held-out loss X; feasible if loss <= Y
    (within m% of AdamW's)``, and a warning line when ``Y`` is not below the held-out loss
    before training (the guard then cannot tell training from not training)."""
    limit = quality_limit(float(reference["heldout_loss"]), loss_margin)
    text = (f"AdamW reference held-out loss {reference['heldout_loss']:.4f}; feasible if loss "
            f"<= {limit:.4f} (within {100 * loss_margin:g}% of AdamW's)")
    halves = reference.get("throughput_halves")
    if halves and min(halves) > 0 and max(halves) / min(halves) > UNSTEADY:
        text += (f"\nwarning: the AdamW reference's throughput changed "
                 f"{max(halves) / min(halves):.2f}x between the halves of its run "
                 f"({halves[0]:.3g} then {halves[1]:.3g} "
                 f"{reference.get('unit', 'items')}/s): the machine is busy or still warming up, "
                 "and every speed-up against it is as unsteady; quiet the machine, or raise "
                 "--skip-steps and --steps")
    init = reference.get("initial_loss")
    if init is not None and limit >= init:
        text += (f"\nwarning: the guard ({limit:.4f}) is not below the held-out loss before "
                 f"training ({init:.4f}): it cannot tell training from not training on this "
                 "workload; lower --loss-margin or train longer (--steps)")
    return text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_and_measure(factory: Callable[..., Any], make_optimizer: Callable[[Any], Any],
                      ts: TuneSettings, *,
                      report: Callable[[int, float], None] | None = None,
                      report_every: int = 10, initial_loss: bool = False) -> TrainResult:
    """Train ``ts.steps`` steps of a fresh workload with ``make_optimizer(params)``
    (``params``: the model's ``named_parameters()``, so ZenFlow's dense set finds its
    params by name; ``torch.optim`` optimizers take them too).

    ``report(step, throughput_so_far)`` is called every ``report_every`` measured steps (it
    may raise ``optuna.TrialPruned``)."""
    device = torch.device(ts.device)
    wl: Workload = build_workload(factory, seed=ts.seed, device=device, name=ts.workload)
    init = heldout_loss(wl) if initial_loss else None
    opt = make_optimizer(wl.model.named_parameters())
    t0 = time.perf_counter()
    items, measured, loss_val, diverged = 0, 0, math.nan, False
    mid = ts.skip_steps + (ts.steps - ts.skip_steps) // 2
    t_mid, items_mid = None, 0
    try:
        it = iter(wl.batches)
        for step in range(1, ts.steps + 1):
            batch, value = _train_step(wl, opt, it, step, ts)
            if value is None:  # NonFiniteGradientError: the run diverged
                diverged = True
                break
            loss_val = value
            if not math.isfinite(loss_val):
                diverged = True
                break
            if step == ts.skip_steps:
                _sync(device)
                t0 = time.perf_counter()
            elif step > ts.skip_steps:
                items += wl.count(batch)
                measured += 1
                if step == mid and ts.steps - ts.skip_steps >= 4:
                    _sync(device)
                    t_mid, items_mid = time.perf_counter(), items
                if report is not None and measured % report_every == 0 and step < ts.steps:
                    _sync(device)
                    report(step, items / max(time.perf_counter() - t0, 1e-9))
        if hasattr(opt, "synchronize") and not diverged:
            opt.synchronize()
        _sync(device)
        seconds = time.perf_counter() - t0
        stats = dict(opt.stats()) if hasattr(opt, "stats") else {}
    finally:
        if hasattr(opt, "close"):
            opt.close()
    hl = math.nan if diverged else heldout_loss(wl)
    if not math.isfinite(hl):
        diverged = True
    thr = items / seconds if measured and seconds > 0 else math.nan
    halves = None if diverged else _halves(t0, t_mid, seconds, items, items_mid)
    return TrainResult(throughput=thr, heldout_loss=hl, final_train_loss=loss_val,
                       diverged=diverged, measured_steps=measured, measured_seconds=seconds,
                       unit=wl.unit, stats=_jsonable(stats), initial_loss=init,
                       throughput_halves=halves)


def _train_step(wl: Workload, opt: Any, it: Any, step: int,
                ts: TuneSettings) -> tuple[Any, float | None]:
    """Step ``step`` of :func:`train_and_measure`: its batch and its training loss (None where
    ``opt.step()`` found a gradient that is not finite: the run diverged)."""
    try:
        batch = next(it)
    except StopIteration:
        raise RuntimeError(f"workload {ts.workload!r} ran out of batches at step {step} "
                           f"(the study needs {ts.steps})") from None
    loss = wl.loss_fn(wl.model, batch)
    loss.backward()
    try:
        opt.step()
    except FloatingPointError:  # NonFiniteGradientError
        return batch, None
    opt.zero_grad(set_to_none=True)
    return batch, float(loss.detach())


def _halves(t0: float, t_mid: float | None, seconds: float, items: int,
            items_mid: int) -> tuple[float, float] | None:
    """The throughput of each half of the measured steps (None without a clean midpoint)."""
    if t_mid is not None and t0 < t_mid < t0 + seconds:
        return (items_mid / (t_mid - t0), (items - items_mid) / (t0 + seconds - t_mid))
    return None


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (bool, int, str)) or v is None:
            out[k] = v
        elif isinstance(v, float):
            out[k] = v if math.isfinite(v) else None
    return out


def measure_reference(factory: Callable[..., Any], ts: TuneSettings) -> dict[str, Any]:
    """Full ``torch.optim.AdamW`` on the same workload, data and seed: the quality reference."""
    def make(params):
        return torch.optim.AdamW(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                                 weight_decay=ts.weight_decay)

    res = train_and_measure(factory, make, ts, initial_loss=True)
    if res.diverged:
        raise RuntimeError("the AdamW reference run diverged (non-finite loss); lower --lr")
    return {"optimizer": "torch.optim.AdamW", "heldout_loss": res.heldout_loss,
            "initial_loss": res.initial_loss,
            "throughput": res.throughput, "unit": res.unit,
            "throughput_halves": (list(res.throughput_halves) if res.throughput_halves
                                  else None),
            "final_train_loss": res.final_train_loss, "steps": ts.steps}


class Objective:
    """``optuna`` objective: returns throughput (maximise); sets the ``quality`` constraint."""

    def __init__(self, factory: Callable[..., Any], space: SearchSpace, ts: TuneSettings,
                 reference: dict[str, Any], report_every: int = 10):
        self.factory = factory
        self.space = space
        self.ts = ts
        self.reference = reference
        self.limit = quality_limit(float(reference["heldout_loss"]), ts.loss_margin)
        self.report_every = report_every

    def __call__(self, trial: optuna.Trial) -> float:
        from zenflow_triton import ZenFlowOptimizer

        settings = self.space.suggest(trial)
        trial.set_user_attr("settings", settings)
        ts = self.ts

        def make(params):
            return ZenFlowOptimizer(params, lr=ts.lr, betas=ts.betas, eps=ts.eps,
                                    weight_decay=ts.weight_decay, **settings)

        def report(step: int, thr: float) -> None:
            trial.report(thr, step)
            if trial.should_prune():
                trial.set_user_attr("pruned_at_throughput", thr)
                raise optuna.TrialPruned(f"throughput {thr:.0f} at step {step} is clearly "
                                         "below the best feasible trial")

        try:
            res = train_and_measure(self.factory, make, ts, report=report,
                                    report_every=self.report_every)
        except optuna.TrialPruned:
            raise
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            raise
        violation = (DIVERGED_VIOLATION if res.diverged
                     else res.heldout_loss - self.limit)
        set_quality_constraint(trial, violation)
        trial.set_user_attr("heldout_loss", None if res.diverged else res.heldout_loss)
        trial.set_user_attr("reference_loss", self.reference["heldout_loss"])
        trial.set_user_attr("loss_limit", self.limit)
        trial.set_user_attr("feasible", violation <= 0)
        trial.set_user_attr("diverged", res.diverged)
        trial.set_user_attr("unit", res.unit)
        trial.set_user_attr("stats", res.stats)
        if res.diverged or not math.isfinite(res.throughput):
            return 0.0
        return res.throughput


# ---- constraints: Trial.set_constraint (optuna >= 5) or a constraints_func (optuna 4) ----
CONSTRAINT_ATTR = "quality_violation"


def set_quality_constraint(trial: optuna.Trial, violation: float) -> None:
    trial.set_user_attr(CONSTRAINT_ATTR, float(violation))
    if hasattr(trial, "set_constraint"):
        trial.set_constraint("quality", float(violation))


def constraints_func(trial: optuna.trial.FrozenTrial) -> list[float]:
    """For optuna < 5 (``TPESampler(constraints_func=...)``): read the recorded violation.
    A pruned trial has none recorded and counts as feasible for the sampler (it is slow,
    and pruned trials never become the best trial)."""
    return [float(trial.user_attrs.get(CONSTRAINT_ATTR, 0.0))]


def is_feasible(trial: optuna.trial.FrozenTrial) -> bool:
    v = trial.user_attrs.get(CONSTRAINT_ATTR)
    return v is not None and v <= 0
