"""One fine-tuning run of a convergence study, with the recipe fine-tuning scripts use: linear
learning-rate warm-up over the first 10% of the steps (then constant, or with
``schedule="linear"`` a linear decay to zero at the last step, the HF Trainer's default), gradient clipping at
norm 1.0, weight decay 0.01, held-out metrics before the first step, every ``eval_every``
steps and after the last.

A ZenFlow run is evaluated after ``opt.eval()`` (pending host results applied, as a user's
evaluation would see them; it shortens that window's staleness once) and put back with
``opt.train()``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch

from zenflow_triton import ZenFlowOptimizer

# Each entry names what it ran, so rows in a JSON stay reproducible when defaults change:
# the rows made before the dense set existed split every matrix (dense_params=()).
_SPLIT = dict(dense_params=())
_AGGRESSIVE = dict(topk_ratio=0.02, update_interval=8)
WARMUP_AS_LR = "lr"
"""An optimizer's ``warmup_steps`` that :func:`run` replaces by its learning rate's warm-up."""

OPTIMIZERS: dict[str, dict[str, Any] | None] = {
    "adamw": None,  # torch.optim.AdamW
    "zero-offload": dict(topk_ratio=0.0, update_interval=1, overlap=False, **_SPLIT),
    "zenflow": dict(host_lr_scale="sqrt", **_SPLIT),  # the defaults of 2026-12-03/04
    "zenflow-aggressive": dict(host_lr_scale="sqrt", **_AGGRESSIVE, **_SPLIT),
    # not in the study's default list: the defaults and aggressive with the other step-size
    # rules (1: ZenFlow's and DeepSpeed's semantics, the default before the study; n: "auto")
    "zenflow-scale-1": dict(host_lr_scale=1.0, **_SPLIT),
    "zenflow-aggressive-scale-1": dict(host_lr_scale=1.0, **_AGGRESSIVE, **_SPLIT),
    "zenflow-scale-n": dict(host_lr_scale="auto", **_SPLIT),
    # the adaptive rule (host.step_size): between sqrt(n) and n by the window's signal fraction
    "zenflow-adaptive": dict(host_lr_scale="adaptive", **_SPLIT),
    "zenflow-aggressive-adaptive": dict(host_lr_scale="adaptive", **_AGGRESSIVE, **_SPLIT),
    # the dense set (embeddings and the LM head whole on the device, AdamW every step)
    "zenflow-dense": dict(host_lr_scale="sqrt"),
    "zenflow-adaptive-dense": dict(host_lr_scale="adaptive"),
    "zenflow-aggressive-adaptive-dense": dict(host_lr_scale="adaptive", **_AGGRESSIVE),
    # ... with each window's result applied 2 steps after it (half the window) instead of 4
    "zenflow-adaptive-dense-delay2": dict(host_lr_scale="adaptive", apply_delay=2),
    "zenflow-aggressive-adaptive-dense-delay4": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                     apply_delay=4),
    # ... applied the step after the window (the least staleness that still overlaps)
    "zenflow-adaptive-dense-delay1": dict(host_lr_scale="adaptive", apply_delay=1),
    "zenflow-aggressive-adaptive-dense-delay1": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                     apply_delay=1),
    # ... each window's result applied at its own boundary (no overlap: the least staleness)
    "zenflow-aggressive-adaptive-dense-sync": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                   overlap=False),
    # ... and a reselection every second window (instead of every 16th)
    "zenflow-aggressive-adaptive-dense-sel2": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                   select_interval=16),
    # the host moments decayed by beta ** n per window of n gradients (host_betas="window")
    "zenflow-adaptive-dense-window": dict(host_lr_scale="adaptive", host_betas="window"),
    "zenflow-aggressive-adaptive-dense-window": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                     host_betas="window"),
    "zenflow-adaptive-dense-window-delay1": dict(host_lr_scale="adaptive", host_betas="window",
                                                 apply_delay=1),
    "zenflow-aggressive-adaptive-dense-window-delay1": dict(
        host_lr_scale="adaptive", **_AGGRESSIVE, host_betas="window", apply_delay=1),
    # ZenFlow's warm-up (synchronous AdamW, every column on the host) over the learning
    # rate's warm-up (the first 10% of the steps), where the deferred columns lag most
    "zenflow-adaptive-dense-warmlr": dict(host_lr_scale="adaptive", warmup_steps=WARMUP_AS_LR),
    "zenflow-aggressive-adaptive-dense-warmlr": dict(host_lr_scale="adaptive", **_AGGRESSIVE,
                                                     warmup_steps=WARMUP_AS_LR),
    # the least device memory (what fits an 8B model on a 40 GB card): the window summed on
    # the host in bf16, every matrix split (no dense set)
    "zenflow-lean": dict(host_lr_scale="adaptive", accumulate_on="host",
                         accumulator_dtype="bfloat16", **_SPLIT),
    # the defaults' columns with a window of 16 (what the tiny LM's guard let the GPU profiles
    # take before the tuner judged quality on real models), and with the window's moments'
    # horizon and apply_delay=1 (issue 48: a screen on the noisy task first)
    "zenflow-adaptive-dense-x16": dict(host_lr_scale="adaptive", update_interval=16),
    "zenflow-adaptive-dense-x16-window-delay1": dict(host_lr_scale="adaptive",
                                                     update_interval=16, host_betas="window",
                                                     apply_delay=1),
    # what fits an 8B model on a 24 GB card (2048 tokens per step, gradient streaming): the
    # lean corner at 1% of the columns on the device, a window of 8 with the window's moments'
    # horizon and its result applied a step after it (issue 48)
    "zenflow-lean-0.01x8-window-delay1": dict(
        host_lr_scale="adaptive", accumulate_on="host", accumulator_dtype="bfloat16",
        topk_ratio=0.01, update_interval=8, host_betas="window", apply_delay=1, **_SPLIT),
    # the fresh pair with a window of 2: half the staleness, for the rows the pair misses by
    # a hair (issue 50)
    "zenflow-adaptive-dense-x2-window-delay1": dict(host_lr_scale="adaptive", update_interval=2,
                                                    host_betas="window", apply_delay=1),
    # a window of one step: every host-owned column gets its Adam step one step late (the
    # result of step t lands at t + 1), the shortest window there is; one schedule (a window
    # of one gradient has no horizon of its own, and its result cannot land sooner)
    "zenflow-adaptive-dense-x1": dict(host_lr_scale="adaptive", update_interval=1),
    # what a 24 GB card can hold for a 7-8B model: the lean corner (the window summed on the
    # host in bf16, no dense set) at 1-2% of the columns on the device, with the pair's
    # schedule, at windows of 2 and 4 (shorter than the 0.01 x 8 that fails on SmolLM2); and
    # with the host moments in bf16, what fits a 128 GB desktop's host beside them
    **{f"zenflow-lean-{k:g}x{ui}{tag}-window-delay1": dict(
        host_lr_scale="adaptive", accumulate_on="host", accumulator_dtype="bfloat16",
        topk_ratio=k, update_interval=ui, host_betas="window", apply_delay=1, **_SPLIT,
        **({"host_state_dtype": "bfloat16"} if tag else {}))
       for k in (0.01, 0.02) for ui in (2, 4) for tag in ("", "-bf16state")},
    # torch's AdamW with fused=True: AdamW's arithmetic through another kernel (its results
    # differ from the for-loop's in the last bits). Its gap to "adamw" on the same seed is the
    # noise floor of a paired comparison, fp32 rounding amplified by training; not a ZenFlow
    # setting (the quality store leaves it out). ZenFlow's own topk_ratio=1 is no such floor:
    # on CPU it is AdamW bit for bit.
    "adamw-fused": dict(torch_adamw="fused"),
    # one selection for the whole 200-step run (no reselection, no migration after step 1):
    # is a reselection what the Gemma runs' last 7 steps pay for? (issue 50)
    "zenflow-adaptive-dense-sel200": dict(host_lr_scale="adaptive", select_interval=200),
    "zenflow-adaptive-dense-window-delay1-sel200": dict(host_lr_scale="adaptive",
                                                        host_betas="window", apply_delay=1,
                                                        select_interval=200),
    # the pair with the "sqrt" host step size instead of "adaptive": is the adaptive
    # multiplier what Gemma's seed 1 pays for late in the run? (issue 50)
    "zenflow-dense-window-delay1": dict(host_lr_scale="sqrt", host_betas="window",
                                        apply_delay=1),
    # the fresh pair for the first 64 steps (the first selection interval), then the stale
    # default: the script switches the optimizer's config after step 64, and step 65's
    # reselection drains the pipeline first (issue 50: is Gemma's lag an early one? no)
    "zenflow-adaptive-dense-fresh64": dict(host_lr_scale="adaptive", host_betas="window",
                                           apply_delay=1, stale_after=64),
    # the library's defaults since fresh_if_spread (issue 50): the schedule of
    # zenflow-adaptive-dense, switched to zenflow-adaptive-dense-window-delay1's where the
    # first selection measures a spread gradient
    "zenflow-defaults-fresh-if-spread": dict(host_lr_scale="adaptive", fresh_if_spread=True),
}
STUDY_OPTIMIZERS = ("adamw", "zero-offload", "zenflow", "zenflow-aggressive")


def _torch(zenflow: dict[str, Any] | None) -> bool:
    """The setting is torch's AdamW (``None``, or ``adamw-fused``'s marker)."""
    return zenflow is None or "torch_adamw" in zenflow


def as_run(zenflow: dict[str, Any]) -> dict[str, Any]:
    """The ZenFlow settings a named setting trains with: the schedule as written,
    ``fresh_if_spread`` only where it says so (the rows before it existed ran without it).
    ``quality_store.py`` keys each row by these."""
    return {"fresh_if_spread": False, **zenflow}


def make_optimizer(params, lr: float, zenflow: dict[str, Any] | None):
    if _torch(zenflow):
        fused = zenflow is not None and zenflow["torch_adamw"] == "fused"
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=fused or None)
    return ZenFlowOptimizer(params, lr=lr, weight_decay=0.01, **as_run(zenflow))


def run(job, *, zenflow: dict[str, Any] | None, lr: float, steps: int,
        eval_every: int, schedule: str = "constant",
        verbose: bool = False) -> dict[str, Any]:
    """Train ``job`` for ``steps`` steps; returns the curve of held-out metrics, the final
    ones, the loss before training, wall seconds and, for ZenFlow, host windows run."""
    model = job.model
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # ZenFlow gets the names (its dense set is chosen by name); AdamW the tensors
    warm = max(1, int(0.1 * steps))
    if zenflow is not None and zenflow.get("warmup_steps") == WARMUP_AS_LR:
        zenflow = dict(zenflow, warmup_steps=warm)
    stale_after = None  # a script-side switch to the stale default (a study setting only)
    if zenflow is not None and "stale_after" in zenflow:
        zenflow = dict(zenflow)
        stale_after = zenflow.pop("stale_after")
    opt = make_optimizer(params if _torch(zenflow) else named, lr, zenflow)
    if schedule not in ("constant", "linear"):
        raise ValueError(f"schedule must be 'constant' or 'linear', got {schedule!r}")

    def factor(s: int) -> float:  # the multiplier of step s + 1 (LambdaLR counts from 0)
        if s + 1 < warm or schedule == "constant":
            return min(1.0, (s + 1) / warm)
        return max(0.0, (steps - s) / (steps - warm + 1))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    curve = [dict(step=0, **job.evaluate(model))]
    t0 = time.perf_counter()
    diverged = False
    for step in range(1, steps + 1):
        batch = next(job.batches)
        loss = job.loss_fn(model, batch)
        if not math.isfinite(loss.item()):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step == stale_after:
            opt.config = opt.config.replace(host_betas="step", apply_delay=None)
        sched.step()
        if verbose and step % 10 == 0:
            print(f"  step {step}/{steps} loss {loss.item():.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if step % eval_every == 0 or step == steps:
            if isinstance(opt, ZenFlowOptimizer):
                opt.eval()
            curve.append(dict(step=step, **job.evaluate(model)))
            if isinstance(opt, ZenFlowOptimizer):
                opt.train()
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = dict(steps=steps, lr=lr, schedule=schedule, seconds=seconds, curve=curve,
                               init=curve[0], diverged=diverged)
    if isinstance(opt, ZenFlowOptimizer):
        st = opt.stats()
        out["host_windows"] = st.get("host_updates", st.get("windows"))
        opt.close()
    final = curve[-1] if not diverged else dict(step=step, loss=math.inf)
    out["final"] = final
    out["diverged"] = diverged or not math.isfinite(final["loss"]) \
        or final["loss"] > curve[0]["loss"]
    return out
