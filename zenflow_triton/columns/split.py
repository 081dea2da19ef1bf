"""A reselection as the optimizer runs it: plan (score and pick every matrix's columns on
its device, the picks brought to the host in one copy per device, with the step's NaN/inf
flags riding along when asked), then migrate (the device half keeps the new host-owned
indices that the migration uploaded)."""

from __future__ import annotations

import torch

from ..config import ZenFlowConfig
from ..state import MATRIX, classify
from .layout import view2d
from .migration import migrate_many
from .selection import Move, plan_selection
from .spread import peak_lr


class ColumnSplit:
    def __init__(self, ops, link, config: ZenFlowConfig, shard, device_half,
                 spread=None) -> None:
        self.ops, self.link, self.config, self.shard = ops, link, config, shard
        self.device_half = device_half
        self.spread = spread
        """A ``columns.spread.Spread``: while it is pending, each plan's scores go to it."""

    def plan(self, work, states, finite=None, check_step: int | None = None,
             scores: dict | None = None) -> list[Move]:
        """The moves of the matrices of ``work`` ((group, param, grad) triples); with
        ``check_step``, ``finite`` (a ``guards.finite_check.FiniteWatch``) judges the step's
        NaN/inf check from the same copy (NonFiniteGradientError before any change).
        ``scores``: param -> column scores made already (gradient streaming)."""
        matrices = [w for w in work if states[w[1]]["kind"] == MATRIX]
        flags = {} if check_step is None else finite.flags(work)
        measure = None
        if self.spread is not None and self.spread.pending:
            self.spread.begin()  # an earlier plan of a step that then failed counts no more
            measure = self.spread.measure
            self._measure_whole(work, states)
            self._weigh(matrices)
        moves, reads = plan_selection(matrices, states, self.ops, self.link, self.config,
                                      self.shard, also=flags, scores=scores, measure=measure)
        if check_step is not None:
            finite.judge(work, check_step, reads)
        return moves

    def _measure_whole(self, work, states) -> None:
        """The spread measure counts every matrix of the model, as ``zenflow-tune diagnose``
        does: also those kept whole on the device (the dense set: embeddings, LM head),
        scored here once, summed over the ranks where they are split by rows."""
        # kept whole only by name: a matrix by the shape rule (state.classify without it)
        whole = [(p, g) for _, p, g in work if g is not None and states[p]["kind"] != MATRIX
                 and classify(self.spread.owner_of(p), self.config) == MATRIX]
        if not whole:
            return
        scores = [self.ops.column_scores(view2d(g, like=p), self.config.score)
                  for p, g in whole]
        if self.shard is not None:
            scores = self.shard.sum_rows(scores, "an all-reduce of the whole matrices' scores")
        for (p, _), s in zip(whole, scores):
            self.spread.measure(p, s)

    def _weigh(self, matrices) -> None:
        """The window travel's weights: each split matrix's squared norm (one fused norm per
        device, summed over the ranks where its rows are split) and its group's peak lr."""
        if not matrices:
            return
        by_device: dict = {}
        for group, p, _ in matrices:
            by_device.setdefault(p.device, []).append((group, p))
        for items in by_device.values():
            norms = torch._foreach_norm([p.detach() for _, p in items])
            sumsq = torch.stack([n.float() for n in norms]).pow(2)
            if self.shard is not None:
                sumsq = self.shard.sum_rows([sumsq], "an all-reduce of the split weights' norms")[0]
            for (group, p), s in zip(items, sumsq):
                self.spread.weigh(p, peak_lr(group), s)

    def migrate(self, moves: list[Move]) -> int:
        """Carry out ``moves``; returns how many columns changed owner."""
        moved, indices = migrate_many(moves, ops=self.ops, link=self.link, shard=self.shard)
        self.device_half.remember(indices)
        return moved
