"""The schedule as a table: what each step does for update_interval, apply_delay, overlap,
warm-up and select_interval, with no tensors (zenflow_triton.schedule.plan_step).

One token per step: "-" nothing, else letters in the order they happen:
W warm-up, S reselect, d drain before the launch (always), p the same if anything is
pending, B boundary (a host job launches), n that job is applied in this step,
D drain at the end of the step (always), P the same if anything is pending.
"""

from __future__ import annotations

import pytest

from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.schedule import plan_step

DRAIN = {None: "", "always": "d", "if_pending": "p"}


def token(plan) -> str:
    out = ("W" if plan.warmup else "") + ("S" if plan.reselect else "")
    out += DRAIN[plan.drain_before] + ("B" if plan.boundary else "")
    out += "n" if plan.apply_now else ""
    out += DRAIN[plan.drain_after].upper()
    return out or "-"


TABLE = [
    # (config fields, tokens of steps 1, 2, ...)
    (dict(update_interval=4), "S - - dB - - - dB - - - dB"),
    (dict(update_interval=4, apply_delay=4), "S - - dB - - - dB"),
    (dict(update_interval=4, apply_delay=2), "S P - pB - P - pB - P - pB"),
    (dict(update_interval=4, apply_delay=1), "SP - - pB P - - pB P"),
    (dict(update_interval=4, apply_delay=3), "S - P pB - - P pB"),
    (dict(update_interval=4, overlap=False), "S - - BnD - - - BnD"),
    (dict(update_interval=1, overlap=False), "SBnD BnD BnD BnD"),
    (dict(update_interval=1), "SdB dB dB dB"),
    (dict(update_interval=2, select_interval=4), "S dB - dB S dB"),
    (dict(update_interval=4, warmup_steps=2), "WBnD WBnD S - - dB - - - dB"),
    (dict(update_interval=4, warmup_steps=2, apply_delay=2),
     "WBnD WBnD S P - pB - P - pB"),
    (dict(update_interval=3, warmup_steps=1, overlap=False), "WBnD S - BnD - - BnD"),
    (dict(update_interval=2, select_interval=4, overlap=False), "S BnD - BnD S BnD"),
]


@pytest.mark.parametrize("fields,expected", TABLE, ids=[str(f) for f, _ in TABLE])
def test_schedule_table(fields, expected):
    cfg = ZenFlowConfig(**fields)
    got = " ".join(token(plan_step(t, cfg)) for t in range(1, len(expected.split()) + 1))
    assert got == expected


def test_default_select_interval_is_sixteen_windows():
    cfg = ZenFlowConfig(update_interval=4)
    reselecting = [t for t in range(1, 200) if plan_step(t, cfg).reselect]
    assert reselecting == [1, 65, 129, 193]


@pytest.mark.parametrize("fields", [f for f, _ in TABLE])
def test_single_step_window_and_steady(fields):
    """A window is one step exactly in warm-up and at update_interval 1; a steady step waits
    for nothing and applies nothing."""
    cfg = ZenFlowConfig(**fields)
    for t in range(1, 40):
        plan = plan_step(t, cfg)
        assert plan.single_step_window == (plan.boundary
                                           and (plan.warmup or cfg.update_interval == 1))
        if plan.steady:
            assert plan.drain_before is None and not plan.apply_now
        assert plan.apply_now == (plan.boundary and (plan.warmup or not cfg.overlap))


@pytest.mark.parametrize("interval,delay", [(4, None), (4, 1), (4, 2), (4, 3), (8, 5), (1, 1)])
def test_every_overlapped_window_is_applied_at_its_delay(interval, delay):
    """Each window launched at boundary b is applied at the end of step b + delay: a
    drain-if-pending there, or (delay == interval) the next boundary's drain before its
    launch, and at no step in between."""
    cfg = ZenFlowConfig(update_interval=interval, apply_delay=delay, select_interval=None)
    d = cfg.effective_apply_delay
    plans = {t: plan_step(t, cfg) for t in range(1, 6 * interval + 1)}
    for b in [t for t, p in plans.items() if p.boundary][:-1]:
        between = [plans[t] for t in range(b + 1, b + d)]
        assert all(p.drain_before is None and p.drain_after is None for p in between)
        at = plans[b + d]
        assert (at.drain_before if d == interval else at.drain_after) is not None
