"""A reselection as the optimizer runs it: plan (score and pick every matrix's columns on
its device, the picks brought to the host in one copy per device, with the step's NaN/inf
flags riding along when asked), then migrate (the device half keeps the new host-owned
indices that the migration uploaded)."""

from __future__ import annotations

from ..config import ZenFlowConfig
from ..state import MATRIX
from .migration import migrate_many
from .selection import Move, plan_selection


class ColumnSplit:
    def __init__(self, ops, link, config: ZenFlowConfig, shard, device_half) -> None:
        self.ops, self.link, self.config, self.shard = ops, link, config, shard
        self.device_half = device_half

    def plan(self, work, states, finite=None, check_step: int | None = None,
             scores: dict | None = None) -> list[Move]:
        """The moves of the matrices of ``work`` ((group, param, grad) triples); with
        ``check_step``, ``finite`` (a ``guards.finite_check.FiniteWatch``) judges the step's
        NaN/inf check from the same copy (NonFiniteGradientError before any change).
        ``scores``: param -> column scores made already (gradient streaming)."""
        matrices = [w for w in work if states[w[1]]["kind"] == MATRIX]
        flags = {} if check_step is None else finite.flags(work)
        moves, reads = plan_selection(matrices, states, self.ops, self.link, self.config,
                                      self.shard, also=flags, scores=scores)
        if check_step is not None:
            finite.judge(work, check_step, reads)
        return moves

    def migrate(self, moves: list[Move]) -> int:
        """Carry out ``moves``; returns how many columns changed owner."""
        moved, indices = migrate_many(moves, ops=self.ops, link=self.link, shard=self.shard)
        self.device_half.remember(indices)
        return moved
