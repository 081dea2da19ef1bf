"""ZenFlowOptimizer: the ``torch.optim`` surface, and the step as a straight sequence of calls.

This module decides nothing about *when* (``schedule.plan_step``) or *how*: the checks
(``guards``), the column rule and migration (``columns``), the device half (``device``), the
host windows, jobs and apply (``host``), the state (``state``), state dicts
(``checkpoint``), data parallelism and FSDP2 (``dist``), ``stats()`` (``stats``). It holds
the parts and calls them in the order of the algorithm. Where a new feature's code goes:
docs/design.md, "Map of the code".
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Iterable

import torch

from .checkpoint.methods import StateDictMethods
from .checkpoint.state_dict import window_open, without_kernel_choices
from .grads.clipping import Clipper
from .columns.split import ColumnSplit
from .columns.spread import Spread
from .config import ZenFlowConfig, check_hyper
from .device import DeviceHalf
from .dist.fsdp import LocalState, check_same_kind, local, localize
from .dist.shard import RowShard
from .fit import DoesNotFitError, fitted, profile_settings
from .guards.faults import OptimizerFailedError, StepGuard
from .guards.finite_check import FiniteWatch, undo_of
from .guards.inputs import NonFiniteGradientError, Work, check_names, check_params, collect
from .host import HostPipeline, HostWorkerError
from .host.apply import anything_pending, apply_pending
from .host.window import close_windows, launched_at, step_hyper
from .kernels import KernelOps, get_ops, resolve_backend
from .lifecycle import HostThreads
from .params import ParamIndex
from .schedule import StepPlan, plan_step
from .state import needs_setup, prepared, unselected
from .stats import optimizer_stats
from .grads.stream import GradStream, check_streamable
from .transfer import Link


GONE_GRACE_S = 0.2
"""How long :meth:`ZenFlowOptimizer.close` after ``destroy_process_group()`` sleeps: the
process group lives on inside DDP's reducer, and gloo's thread releases its last finished
collective with the GIL; if the main thread then frees the reducer (holding the GIL) before
that thread got it, the group's destructor waits for the thread forever (docs/distributed.md,
"The end of a run")."""


class ZenFlowOptimizer(HostThreads, StateDictMethods, torch.optim.Optimizer):
    """AdamW whose important columns update on the device every step and the rest on the host.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts (per-group
            lr / betas / eps / weight_decay), as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: AdamW hyperparameters (decoupled weight decay).
        config: a :class:`ZenFlowConfig`; or give its fields as keywords (not both).
        process_group: data parallelism (DDP: the gradients are averaged before ``step()``):
            the ``torch.distributed`` group whose ranks share the host work, each keeping
            and updating only its rows of every host half (``dist.shard``); None: the default
            group when torch.distributed is initialized, else a single process. Params of a
            model wrapped with FSDP2's ``fully_shard`` (DTensors sharded by rows on a 1-D
            mesh): each rank works on its own rows (``dist.fsdp``), over the mesh's group.
        fit: when params, gradients and device state would not fit the accelerator: raise
            ``DoesNotFitError`` ("check"), take ``fit.LEAN`` with a warning ("lean"), "skip".
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, config: ZenFlowConfig | None = None,
                 process_group: Any = None, fit: str = "check", **config_fields: Any) -> None:
        config_fields = without_kernel_choices(config_fields, "keyword arguments")
        params, cfg = fitted(params, ZenFlowConfig.of(config, config_fields), fit)
        self.config = cfg
        check_hyper(lr, betas, eps, weight_decay, where="defaults")
        self._index = ParamIndex(lambda: self.param_groups, cfg, self._owner)
        self._params, self._kind, self._param_name = (self._index.params, self._index.kind,
                                                      self._index.name)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self._check_hyper()
        check_params(self.param_groups, self._kind, self._param_name)
        check_names(self.param_groups, cfg)
        self._states = LocalState(self.state, self._params())
        self._backend = resolve_backend(cfg.backend, self._params())
        self.ops: KernelOps = get_ops(self._backend)
        self.link = Link()
        self._shard = RowShard.for_params(self._params(), process_group, cfg.host_timeout)
        check_streamable(cfg, self._shard)
        # The host half's buffers, jobs and waits (staging, outboxes, the job in flight).
        self._pipeline = HostPipeline.for_config(self.link, cfg)
        self._worker, self._host_adamw = self._pipeline.worker, self._pipeline.adamw
        self._dev = DeviceHalf(self.ops, self.link, self._shard, cfg)
        self._spread = Spread(self.link, self._owner, cfg)  # measured once a run
        self._split = ColumnSplit(self.ops, self.link, cfg, self._shard, self._dev,
                                  self._spread)
        # Gradient streaming's hooks (stream_grads), live grad bytes; clipping (max_grad_norm)
        self._stream = GradStream(cfg, self.ops, self.link, self._pipeline, self._dev,
                                  self.state, lambda: self._global_step + 1, self._param_name,
                                  label=f"the ZenFlowOptimizer at {id(self):#x}")
        self._stream.install(self._params(), self._kind)
        self._clip = Clipper(cfg.max_grad_norm, self._shard, self._stream)
        self._guard = StepGuard(self._pipeline)  # the failed state; all-or-nothing steps
        self._training = True
        self._global_step = 0
        self._last_hyper: list[dict] | None = None  # of the last step (finish() launches at)
        self._own_threads(self._worker, self._host_adamw)
        self._counters = dict(selection_refreshes=0, host_updates=0, columns_migrated=0)
        self._finite = FiniteWatch.for_optimizer(cfg, self._backend, self._shard,
                                                 self._params(), self._param_name)
        self._prepared: tuple[int, dict] | None = None  # prepare_state_dict's, until a change

    def _owner(self, t: torch.Tensor) -> torch.Tensor:
        """The param whose local tensor ``t`` is (FSDP2), else ``t``."""
        states = getattr(self, "_states", None)
        return t if states is None else states.owner(t)

    @property
    def _fsdp(self) -> bool:
        """The params are FSDP2 DTensors (each rank holds its rows of them)."""
        return not self._shard.split_rows

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after refusing AdamW options this optimizer does not implement (named)
        and a Tensor lr."""
        if isinstance(param_group, dict):
            index = len(getattr(self, "param_groups", []))
            param_group = without_kernel_choices(param_group, f"param group {index}")
        super().add_param_group(param_group)
        if hasattr(self, "_states"):  # after construction: checked, and of the same kind
            try:
                check_params(self.param_groups[-1:], self._kind, self._param_name)
                check_same_kind(self.param_groups[-1]["params"], self._fsdp)
            except BaseException:
                self.param_groups.pop()  # nothing of the refused group stays
                raise
            self._states = LocalState(self.state, self._params())
            self._stream.install(self.param_groups[-1]["params"], self._kind)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_profile(cls, name: str, params: Iterable, lr: float = 1e-3,
                     **overrides: Any) -> "ZenFlowOptimizer":
        """Profile ``name``'s tuned settings; ``overrides`` (any keyword of ``__init__``) win."""
        try:
            return cls(params, lr=lr, **profile_settings(name, overrides))
        except DoesNotFitError as e:
            raise type(e)(f"profile {name!r}: {e}") from None

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """What ``GradScaler.step`` asks first: with ``stream_grads`` it refuses, saying why."""
        return self._stream.refuse_grad_scaler()

    # ------------------------------------------------------------------ the step
    # Not for torch.compile: a step waits on host threads and reads host-side schedules, which
    # Dynamo would trace into, graph-break on and recompile at every step count; the device
    # work is already fused kernels (registered ops where compiled code calls them).
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; ``closure`` (re-)computes the loss under grad mode first. All
        or nothing: a KeyboardInterrupt after its first change is raised once it is done
        (``stats()["steps"]`` says whether it counts); anything else raising mid-step leaves
        the optimizer failed (:class:`OptimizerFailedError`)."""
        self._check_open()
        self._guard.check()
        self._own_state()  # a state dict still held keeps its values (checkpoint.lent)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._work()
        plan = plan_step(self._global_step + 1, self.config)
        self._clip.offer(work)  # FSDP2: the ranks' squared norms ride the NaN/inf vote
        moves, defer = self._stream.checked(lambda: self._check(work, plan), work)
        self._prepare_state(work)
        self._guard.before(self._wait_before_step, self._shard.collective, self._global_step)
        self._clip.clip(work)  # after the waits: an interrupted step is retried unclipped
        if defer:  # a masked step's host-side counters come back if it was bad
            step = self._global_step
            self._finite.defer(work, step + 1, undo_of([self._states[p] for _, p, _ in work],
                                                       lambda: setattr(self, "_global_step", step)))
        with self._guard.whole_step(lambda: self._global_step):
            self._global_step += 1
            self._last_hyper = step_hyper(self.param_groups)  # (finish() launches at them)
            self._select(work, plan, moves)
            work, streamed = self._stream.resolve(work)  # cut by the selection in force
            direct = self._device_half(work, plan.single_step_window, streamed)
            self._host_half(plan, direct)
        return loss

    def _work(self) -> Work:
        """Every gradient of the step, validated (FSDP2: this rank's rows), with the
        hyperparameters a scheduler may have written checked and the host worker alive."""
        work = self._stream.work(self.param_groups, collect(self.param_groups,
                                                            self._param_name))
        if self._fsdp:  # FSDP2 may have replaced a param's local tensor
            self._states = LocalState(self.state, self._params())
        work = localize(work, self._param_name)
        self._check_hyper()
        if not self._worker.alive:  # fail before this step changes anything
            raise HostWorkerError("the host worker thread is dead; the optimizer cannot go on "
                                  "(load a checkpoint into a new optimizer)")
        return work

    def _check(self, work: Work, plan: StepPlan) -> tuple[list | None, bool]:
        """The NaN/inf check before any change: read now, deferred on the device (a steady
        step), or read with a reselection's picks, planned now. Returns ``(moves, defer)``."""
        cfg = self.config
        may_defer = cfg.check_finite and self._finite.at_boundary and plan.steady
        setup = (may_defer or plan.reselect) and needs_setup(work, self._states)  # looked at once
        defer = may_defer and not setup
        moves = None
        if plan.reselect and not setup:
            moves = self._split.plan(work, self._states, self._finite,
                                    self._global_step + 1 if cfg.check_finite else None,
                                    self._stream.scores())
        elif cfg.check_finite and not defer:
            self._finite.check(work, self._global_step + 1)
        return moves, defer

    def _select(self, work: Work, plan: StepPlan, moves: list | None) -> None:
        """A reselection (``moves`` planned before any change, or after the drain); after
        warm-up, the first selection of a param seen for the first time."""
        if plan.reselect:
            self._drain()
            self._counters["selection_refreshes"] += 1
            self._migrate(moves if moves is not None else self._split.plan(
                work, self._states, scores=self._stream.scores()))
        elif not plan.warmup:
            fresh = unselected(work, self._states)
            if fresh:
                self._migrate(self._split.plan(fresh, self._states,
                                               scores=self._stream.scores()))
        self.config = self._spread.settle(self.config)  # the first selection: spread?

    def _host_half(self, plan: StepPlan, direct: dict) -> None:
        """The host side of the plan: the apply due before a launch, the launch of the window
        that ends now, the apply due at the end of the step."""
        if self._due(plan.drain_before):
            self._drain()
        if plan.boundary:
            self._launch(direct, plan.apply_now, plan.warmup, f"step {self._global_step}")
        if self._due(plan.drain_after):
            self._drain()

    def _launch(self, direct: dict, apply_now: bool, warmup: bool, label: str) -> None:
        """One host job for every window that holds gradients (``host.window``)."""
        windows = close_windows(self.param_groups, self.state, self.config, self._shard,
                                direct, apply_now, warmup)
        if windows:
            self._counters["host_updates"] += 1
            self._pipeline.launch(windows, apply_now, f"host AdamW of {label}")

    def _due(self, drain) -> bool:
        """Whether a drain of the plan happens (``schedule.Drain``)."""
        return drain == "always" or (drain == "if_pending"
                                     and anything_pending(self._pipeline, self.state))

    def _wait_before_step(self) -> None:
        """The waits of a step that come before any change: a failed host accumulation and
        the copy-in of the accumulators on loan to the job in flight (an interrupt here
        leaves the optimizer before the step). The job the step applies is waited for later,
        after the device half is queued, so the accelerator has work meanwhile; an interrupt
        in that wait is held until the step is done."""
        self._pipeline.check()  # a failed host accumulation raises before any change
        self._pipeline.wait_copy_in()

    def _check_hyper(self, groups: list[dict] | None = None, what: str = "param group") -> None:
        for gi, g in enumerate(self.param_groups if groups is None else groups):
            check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"], where=f"{what} {gi}")

    def _prepare_state(self, work: Work) -> None:
        """Every param of the step with its state made or put back where it belongs."""
        for _, p, _ in work:
            st = prepared(p, self._states[p], kind_of=self._kind, config=self.config,
                          link=self.link, rows_of=self._shard.rows,
                          busy=self._pipeline.inflight, name_of=self._param_name)
            if st is not None:
                self._states[p] = st
                self._dev.forget(p)

    def _migrate(self, moves: list) -> None:
        self._counters["columns_migrated"] += self._split.migrate(moves)

    def _device_half(self, work: Work, single_step_window: bool, streamed: dict) -> dict:
        """Every step: AdamW on the device-owned columns and on the small params, and the
        gradient of the host-owned columns into the window accumulator (``DeviceHalf``).
        Returns the host columns of params whose one-step window hands its gradient to the
        host as it is (``single_step_window``: warm-up, update_interval=1)."""
        self._pipeline.wait_copy_in()  # the accumulators are on loan to the job until copied
        direct, to_host = self._dev.run(work, self._states, single_step_window,
                                        self._finite.skip_of, streamed)
        if to_host:  # the host worker adds them; this thread only queues the copies
            self._pipeline.accumulate(to_host, f"step {self._global_step}")
        return direct

    def _drain(self) -> None:
        """Wait for host work in flight, then write every pending host result into its param
        (``host.apply``); every rank at the same step under data parallelism."""
        self._prepared = None  # what it applies changes the params and the pending state
        failure, self._guard.deferred = self._guard.deferred, None
        apply_pending([(local(p), st) for p in self._params() for st in (self.state.get(p),)
                       if isinstance(st, dict)], self._pipeline, link=self.link,
                      shard=self._shard, ops=self.ops, host_idx=self._dev.host_idx,
                      failure=failure)

    # ------------------------------------------------------------------ public helpers
    def synchronize(self) -> None:
        """Finish all host work and apply it to the params now (changes the schedule once:
        the deferred columns skip their staleness; deterministic)."""
        self._check_open()
        self._guard.check()
        if self.config.check_finite:
            self._finite.settle()  # a deferred NaN/inf check raises here, rolled back
        self._guard.or_fail(self._drain, self._global_step)

    def finish(self) -> None:
        """End training: the open windows go to the host now and every host result is
        applied, so what is saved next holds every gradient given to :meth:`step`. The last
        call of a loop (:meth:`close` makes it); training may go on after it."""
        self.synchronize()  # the job in flight and pending results first
        if any(map(window_open, self.state.values())):
            self._own_state()
            with self._guard.whole_step(lambda: self._global_step):  # all or nothing
                with launched_at(self.param_groups, self._last_hyper):  # its last step's
                    self._launch({}, True, False,
                                 f"the open windows at step {self._global_step}")
                self._drain()

    def close(self, finish: bool = True) -> None:
        """:meth:`finish`, then stop the host threads; idempotent. ``finish=False`` (a state
        handed on), a failed optimizer or a ``with`` left by an exception only stop them."""
        if not finish or getattr(self, "_closed", True) or self._guard.failure is not None:
            return self._stop()
        if self._shard.gone:  # no collective can finish the open window any more
            warnings.warn("close() after destroy_process_group(): the ranks cannot finish the "
                          "open window together any more, so it is left unapplied; call "
                          "close() (or finish()) before destroy_process_group()", UserWarning,
                          stacklevel=2)
            time.sleep(GONE_GRACE_S)  # GIL released: the backend's thread can finish
            return self._stop()
        try:
            self.finish()
        finally:
            self._stop()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; with ``stream_grads`` it also drops the gradients the hooks streamed."""
        super().zero_grad(set_to_none)
        self._stream.discard()

    def train(self) -> "ZenFlowOptimizer":
        self._training = True
        return self

    def eval(self) -> "ZenFlowOptimizer":
        """Apply pending host results now, so evaluation sees the weights of every finished
        window (the open window's gradients wait for its boundary; :meth:`finish` applies
        those too). Like :meth:`synchronize` this changes the trajectory, deterministically:
        the deferred columns skip their staleness once."""
        self._training = False
        if not self._closed:
            self._guard.check()
            self._guard.or_fail(self._drain, self._global_step)
        return self

    @property
    def training(self) -> bool:
        return self._training

    def stats(self) -> dict[str, Any]:
        """Counters, link bytes each way, the device-owned share of elements, the bytes held
        on each side (``stats``), host staging, and host wait/busy seconds."""
        if getattr(self, "_detached", False):
            self._check_open()
        return optimizer_stats(steps=self._global_step, backend=self._backend,
                               streaming={**self._stream.stats(), **self._clip.stats()},
                               shard=self._shard, link=self.link, pipeline=self._pipeline,
                               params=self._params(), state=self.state, kind_of=self._kind,
                               config=self.config, device_indices=self._dev.index_tensors(),
                               counters=self._counters, spread=self._spread.stats())


__all__ = ["ZenFlowOptimizer", "NonFiniteGradientError", "HostWorkerError",
           "OptimizerFailedError"]
