"""The schedule: what one step does, as a pure function of the step number and the config.

With ``t`` the global step (1-based) and ``u = t - warmup_steps``:

* ``t <= warmup_steps``: warm-up. Every column of a matrix param is host-owned and its
  gradient gets a synchronous host AdamW step at once (ZeRO-Offload): each step is a
  one-step window, launched and applied in the step.
* ``u = 1, 1 + select_interval, ...``: a reselection at the start of the step (the optimizer
  drains the host pipeline, scores this step's gradient and migrates the columns that change
  owner).
* ``u % update_interval == 0``: a window boundary. The window's host job launches. With
  ``overlap=False`` its result is applied in the same step; with ``overlap=True`` at the end
  of step ``u + apply_delay`` (default ``apply_delay = update_interval``: at the next
  boundary, just before that boundary's launch).

The apply points follow from the step count alone, never from thread timing, so training is
bit-for-bit reproducible. Whether a result is waiting at an apply point (it is not after a
reselection drained it, for example) is the optimizer's to look up: the plan says "drain if
pending" there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import ZenFlowConfig

Drain = Literal["always", "if_pending"] | None
"""When the optimizer drains (waits for the host job, applies every pending result):
``"always"``, ``"if_pending"`` (only if a job is in flight or a result waits), or not."""


@dataclass(frozen=True)
class StepPlan:
    """What step ``step`` does, in the order it does it: reselect (at its start), the device
    half, then ``drain_before``, the launch of a host job when ``boundary``, ``drain_after``."""

    step: int
    warmup: bool
    """A warm-up step: a synchronous host AdamW step of every host-owned column."""
    reselect: bool
    """Drain, score this step's gradients, migrate the columns that change owner."""
    boundary: bool
    """A window ends: its host job launches."""
    apply_now: bool
    """The job launched in this step is applied in this step (``overlap=False``, warm-up)."""
    single_step_window: bool
    """The window is this step alone (warm-up, ``update_interval=1``): the host-owned columns
    of the gradient go to the host as they are, with no accumulator."""
    drain_before: Drain
    """Before this step's launch: apply the result of the window before."""
    drain_after: Drain
    """At the end of the step: apply this step's result (synchronous) or the result whose
    apply delay ends here."""

    @property
    def steady(self) -> bool:
        """Neither warm-up, reselection nor boundary: a step that waits for no host work."""
        return not (self.warmup or self.reselect or self.boundary)


def plan_step(step: int, config: ZenFlowConfig) -> StepPlan:
    """The plan of global step ``step`` (1-based) under ``config``."""
    interval = config.update_interval
    u = step - config.warmup_steps
    warmup = u <= 0
    reselect = not warmup and (u - 1) % config.effective_select_interval == 0
    boundary = warmup or u % interval == 0
    overlapped = config.overlap and not warmup
    delay = config.effective_apply_delay
    drain_before: Drain = None
    drain_after: Drain = None
    if boundary and overlapped:
        # the window that ended update_interval ago is applied now, unless its apply delay
        # already ended (then only a result left over, e.g. from a loaded checkpoint)
        drain_before = "always" if delay == interval else "if_pending"
    elif boundary:
        drain_after = "always"  # synchronous: this window's result in this step
    elif overlapped and u % interval == delay:
        drain_after = "if_pending"  # the window that ended apply_delay steps ago
    return StepPlan(step=step, warmup=warmup, reselect=reselect, boundary=boundary,
                    apply_now=boundary and not overlapped,
                    single_step_window=boundary and (warmup or interval == 1),
                    drain_before=drain_before, drain_after=drain_after)
