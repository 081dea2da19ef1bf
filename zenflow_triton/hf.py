"""The HF Trainer's checkpoints under data parallelism.

The Trainer calls ``optimizer.state_dict()`` on rank 0 only, but under DDP a ZenFlow state
dict gathers every rank's rows of the host halves: a collective that the other ranks never
join. :class:`ZenFlowCallback` has every rank gather them at the end of a step that will
save (``control.should_save``, set by the Trainer before the callbacks run), through
``ZenFlowOptimizer.prepare_state_dict``; rank 0's ``state_dict()`` then returns that, with no
collective. On one process it costs nothing more than the save itself. Importing this
module needs ``transformers``; the library does not otherwise.

    trainer = transformers.Trainer(..., optimizers=(opt, scheduler),
                                   callbacks=[ZenFlowCallback()])
"""

from __future__ import annotations

from transformers import TrainerCallback

from .optimizer import ZenFlowOptimizer


def _zenflow(optimizer) -> ZenFlowOptimizer | None:
    """The ZenFlowOptimizer inside the Trainer's optimizer (Accelerate wraps it)."""
    seen = 0
    while optimizer is not None and seen < 4:
        if isinstance(optimizer, ZenFlowOptimizer):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


class ZenFlowCallback(TrainerCallback):
    """Gathers the ZenFlow state dict on every rank before the Trainer saves a checkpoint."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save and not args.save_only_model:
            opt = _zenflow(optimizer)
            if opt is not None:
                opt.prepare_state_dict()
        return control
