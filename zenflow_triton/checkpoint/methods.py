"""The optimizer's state-dict methods (mixed into ``ZenFlowOptimizer``, as ``lifecycle``'s
host threads are): ``state_dict``, ``prepare_state_dict``, sharded saves and loads, the AdamW
export and ``load_state_dict``. The format itself is ``state_dict.py``'s; these methods wait
for the host work the state depends on and run torch's hooks in torch's order. They expect
the optimizer's parts (``_pipeline``, ``_guard``, ``_finite``, ``_shard``, ``_dev``...)."""

from __future__ import annotations

import warnings
from typing import Any

from ..dist.fsdp import local_view, refuse
from ..columns.spread import NOT_SAVED
from .lent import lent_of
from .state_dict import (SD_VERSION, adamw_state_dict, build, config_change, read,
                         refuse_open_windows)


class StateDictMethods:
    def state_dict(self) -> dict[str, Any]:
        """Tensors and primitives only; host work in flight finished and saved as pending, to
        be applied at the step it would have been. Under data parallelism: collective, the
        full form (every rank's rows), unless :meth:`prepare_state_dict` made it already."""
        prepared = getattr(self, "_prepared", None)  # a copy (__setstate__) has none
        if prepared is not None and prepared[0] == self._global_step:
            return prepared[1]
        return self._state_dict(gather=True)

    def prepare_state_dict(self) -> None:
        """Gather the full state dict now, on every rank, and keep it until the next change,
        so that one rank's :meth:`state_dict` makes no collective (frameworks that save on
        rank 0 only: ``zenflow_triton.hf.ZenFlowCallback`` calls this before a save)."""
        self._prepared = None
        self._prepared = (self._global_step, self._state_dict(gather=True))

    def save_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Save through ``torch.distributed.checkpoint``, each rank writing only its rows of
        the host halves (collective); :meth:`load_sharded` reads it into any world size.
        See ``zenflow_triton.checkpoint.sharded``."""
        from .sharded import save_sharded
        save_sharded(self._state_dict(gather=False), self._params(), self._shard,
                     checkpoint_id, **dcp_kwargs)

    def load_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Load a :meth:`save_sharded` checkpoint (collective; any world size)."""
        from .sharded import read_sharded
        self.load_state_dict(read_sharded(self._params(), self._shard,
                                          self.config.accumulate_on, checkpoint_id,
                                          **dcp_kwargs))

    def _state_dict(self, gather: bool) -> dict[str, Any]:
        """torch's state_dict (its pre and post hooks in its order) plus the ``zenflow``
        entry; host work in flight finished first. No telemetry: identical runs give
        identical state dicts (``stats()`` has the counters and timings)."""
        if getattr(self, "_detached", False):
            self._check_open()  # explains what a copy lacks
        self._guard.check()
        if self.config.check_finite and not self._closed:
            self._finite.settle()  # a deferred NaN/inf check raises here, rolled back
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if not self._closed:
            self._guard.or_fail(self._pipeline.wait_all, self._global_step)
        sd = build(self.param_groups, self.state, self._params(), self._shard, gather=gather,
                   meta={"version": SD_VERSION, "global_step": self._global_step,
                         "last_step_hyper": self._last_hyper,
                         "config": self.config.to_dict(), "backend": self._backend,
                         "spread": self._spread.state()},
                   fsdp=self._fsdp, config=self.config)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        lent_of(self).lend(sd, self.state)  # kept as of now while held (checkpoint.lent)
        return sd

    def _own_state(self) -> None:
        """Before the optimizer writes its state again (a step, ``finish()``'s launch): the
        prepared state dict dropped, and the tensors a state dict still held shares copied
        (``checkpoint.lent``), so what :meth:`state_dict` handed out keeps its call's values."""
        self._prepared = None
        lent_of(self).reclaim(self.state)

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """This state as ``torch.optim.AdamW.load_state_dict`` takes it (same groups): one
        step count per param, the moments rescaled to it. Applies pending results first;
        refused while a window is open (after :meth:`finish` none is). Collective under DDP."""
        if self._fsdp:
            refuse("to_adamw_state_dict()")
        refuse_open_windows(self._params(), self.state, self._param_name)
        self.synchronize()
        return adamw_state_dict(self._state_dict(gather=True), self._params())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, or a ``torch.optim.AdamW`` one for the same params and
        groups (switching from AdamW mid-training: its moments become the host half and the
        next step selects the device's columns with theirs; the schedule starts afresh).
        Runs torch's load hooks in torch's order; checks every saved tensor against its param
        before anything changes (``checkpoint.state_dict.read``); puts device state on each
        param's device and host state in host memory whatever device or dtype a framework
        moved them to. Loading a good state clears a failure."""
        self._check_open()
        state_dict = dict(state_dict)  # shallow, as torch does
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = read(state_dict, self.param_groups, self.config, self._shard.rows,
                      self._param_name, self._kind,
                      lambda p, saved: local_view(p, saved, self._shard))
        self._check_hyper(loaded.groups, "state_dict param group")
        # the run's spread measurement and the schedule it chose (columns.spread)
        self.config = self._spread.restore(None if loaded.adamw
                                           else loaded.meta.get("spread", NOT_SAVED))
        changed = None if loaded.adamw else config_change(loaded.meta.get("config"),
                                                           self.config)
        if changed:
            warnings.warn(changed, UserWarning, stacklevel=2)
        self._pipeline.forget()  # the work in flight belongs to the state being replaced
        self._stream.rebase()  # streamed gradients: whole again, for the loaded selection
        for g, saved in zip(self.param_groups, loaded.groups):
            g.update(saved)
        self.state.clear()
        self.state.update(loaded.state)  # copies: nothing shared with ``state_dict``'s owner
        lent_of(self).forget()
        self._dev.forget()
        self._finite.discard()  # unread checks of the state being replaced
        self._prepared = None
        self._global_step = 0 if loaded.adamw else int(loaded.meta.get("global_step", 0))
        self._last_hyper = None if loaded.adamw else loaded.meta.get("last_step_hyper")
        self._guard.clear()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
