"""ZenFlowOptimizer: the per-step orchestration (docs/design.md, "The step").

This module decides *when* things happen, in the order of the algorithm: the checks
(``inputs``), selection (``partition``), the device half (``device_half``), the host window
(``windows``, ``host``) and the apply. ``kernels`` compute, ``host`` runs the host half,
``transfer`` moves and counts bytes, ``state_format`` reads and writes state dicts,
``faults`` keeps the failed state and makes steps all or nothing, ``memory`` counts bytes
for ``stats()``, ``lifecycle`` owns the host threads' lifetime.

Schedule, with t the global step (1-based) and u = t - warmup_steps:

* t <= warmup_steps: every column of a matrix param is host-owned, and its gradient gets a
  synchronous host AdamW step at once (ZeRO-Offload).
* selection at the start of steps u = 1, 1 + select_interval, ...: drain the host pipeline
  (wait, apply), score the current gradient, migrate the columns that change owner.
* every step: fused AdamW on the device-owned columns and on small params; the gradient of
  the host-owned columns is added to the window accumulator.
* update boundary u % update_interval == 0: the window-mean gradient goes to the host, which
  runs AdamW on the host-owned columns at lr times the host multiplier (for the default
  "adaptive": between sqrt(n) and n by the window's signal fraction, n the param's number
  of gradients in the window, resolved by the host job; 1 in warm-up, which is plain AdamW;
  see ``ZenFlowConfig.host_lr_scale``). With overlap=True the result is
  written into the param at the end of step u + apply_delay (default: the next boundary),
  with overlap=False at once. The apply point is
  fixed by the step count, never by thread timing, so training is bit-for-bit reproducible.

The host half's buffers, jobs and waits live in ``host.HostPipeline`` (staging, outboxes,
the job in flight, its copy-in, host accumulation), with their ordering invariants written
there; this module only decides when to launch a window, when to wait, and when to apply.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch

from .config import ZenFlowConfig, check_hyper
from .guards.faults import OptimizerFailedError, StepGuard
from .host import HostAdamW, HostPipeline, HostWorker, HostWorkerError
from .guards.finite_check import FiniteWatch
from .dist.fsdp import (LocalState, is_dtensor, local, localize, mesh_group, state_as_dtensors,
                        state_as_local)
from .guards.inputs import NonFiniteGradientError, Work, check_params, collect
from .device import DeviceHalf
from .kernels import KernelOps, get_ops, resolve_backend
from .lifecycle import HostThreads
from .stats import device_owned_fraction, memory_bytes
from .state import MATRIX, classify, init_matrix_state, init_small_state
from .columns.migration import migrate_many
from .columns.selection import plan_selection
from .columns.layout import view2d
from .dist.shard import RowShard, ShardError
from .checkpoint.state_dict import (SD_KEY, SD_VERSION, adamw_state_dict, check_group_flags,
                                    config_change, gather_host_halves, misplaced, pack, read,
                                    restore_param_state)
from .transfer import Link
from .host.apply import apply_results
from .host.window import close_window, share_adaptive_sums


class ZenFlowOptimizer(HostThreads, torch.optim.Optimizer):
    """AdamW whose important columns update on the device every step and the rest on the host.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts (per-group
            lr / betas / eps / weight_decay), as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: AdamW hyperparameters (decoupled weight decay).
        config: a :class:`ZenFlowConfig`; or give its fields as keywords (not both).
        process_group: data parallelism (DDP: the gradients are averaged before ``step()``):
            the ``torch.distributed`` group whose ranks share the host work, each keeping
            and updating only its rows of every host half (``shard``); None: the default
            group when torch.distributed is initialized, else a single process. Params of a
            model wrapped with FSDP2's ``fully_shard`` (DTensors sharded by rows on a 1-D
            mesh): each rank works on its own rows (``fsdp``), over the mesh's group.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, config: ZenFlowConfig | None = None,
                 process_group: Any = None, **config_fields: Any) -> None:
        if config is not None and config_fields:
            raise TypeError("give either config=ZenFlowConfig(...) or its fields as keywords, "
                            f"not both (got config and {sorted(config_fields)})")
        unknown = set(config_fields) - set(ZenFlowConfig.field_names())
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; "
                            f"ZenFlowConfig fields are {ZenFlowConfig.field_names()}")
        self.config = config if config is not None else ZenFlowConfig(**config_fields)
        check_hyper(lr, betas, eps, weight_decay, where="defaults")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self._check_hyper()
        check_params(self.param_groups, self._kind, self._param_name)
        self._states = LocalState(self.state, self._params())
        self._backend = resolve_backend(self.config.backend, self._params())
        self.ops: KernelOps = get_ops(self._backend)
        self.link = Link()
        # FSDP2 split the rows already: the ranks reduce and vote over the mesh's group.
        mesh = mesh_group(self._params())
        if mesh is not None and process_group is not None and process_group is not mesh:
            raise ValueError("process_group: FSDP2 params reduce over their mesh's group; "
                             "leave process_group=None")
        self._shard = RowShard(process_group if mesh is None else mesh,
                               timeout=self.config.host_timeout, split_rows=mesh is None)
        threads = self.config.host_threads or max(1, torch.get_num_threads())
        self._host_adamw = HostAdamW(threads, self.config.chunk_size, self.config.host_timeout,
                                     cores=self.config.host_cores)
        self._worker = HostWorker(self.config.host_timeout)
        # The host half's buffers, jobs and waits (staging, outboxes, the job in flight).
        self._pipeline = HostPipeline(self.link, self._host_adamw, self._worker,
                                      self.config.host_timeout)
        self._dev = DeviceHalf(self.ops, self.link, self._shard, self.config)
        self._guard = StepGuard(self._pipeline)  # the failed state; all-or-nothing steps
        self._training = True
        self._global_step = 0
        self._own_threads(self._worker, self._host_adamw)
        self._counters = dict(selection_refreshes=0, host_updates=0, columns_migrated=0)
        self._finite = FiniteWatch(self._finite_at_boundary(), self._param_name,
                                   vote=None if self._shard.split_rows else self._vote_finite)
        self._prepared: tuple[int, dict] | None = None  # prepare_state_dict's, until a change

    def _finite_at_boundary(self) -> bool:
        """Whether the NaN/inf check is read at boundaries only (``check_finite_at``)."""
        cfg = self.config
        if cfg.check_finite_at == "boundary" and self._backend != "triton":
            raise ValueError('check_finite_at="boundary" needs the Triton backend (its kernels '
                             f'read the device flag), but this optimizer runs backend '
                             f'"{self._backend}"')
        fsdp = not self._shard.split_rows
        if cfg.check_finite_at == "boundary" and fsdp:
            raise ValueError('check_finite_at="boundary" is not supported under FSDP2 yet (a '
                             "rank's device flag would mask only its own rows); use \"step\"")
        if cfg.check_finite_at == "auto":
            return (self._backend == "triton" and cfg.accumulate_on == "device" and not fsdp
                    and any(p.device.type == "cuda" for p in self._params()))
        return cfg.check_finite_at == "boundary"

    def _vote_finite(self, flags: list[bool]) -> list[bool]:
        """FSDP2: whether any rank found each param's rows of the gradient non-finite (one
        all-reduce; a world of one returns ``flags``)."""
        summed = self._shard.all_reduce_sum(torch.tensor(flags, dtype=torch.int32),
                                            "a vote on the gradients' NaN/inf flags")
        return [bool(n) for n in summed]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after refusing AdamW options this optimizer does not implement (named)
        and a Tensor lr."""
        if isinstance(param_group, dict):
            index = len(getattr(self, "param_groups", []))
            check_group_flags(param_group, f"param group {index}")
        super().add_param_group(param_group)
        if hasattr(self, "_states"):  # after construction: checked, and of the same kind
            group = self.param_groups[-1]
            fsdp = not self._shard.split_rows
            try:
                check_params([group], self._kind, self._param_name)
                if any(is_dtensor(p) != fsdp for p in group["params"]):
                    raise ValueError("add_param_group: the new params must be "
                                     + ("FSDP2 DTensors" if fsdp else "plain tensors")
                                     + ", as this optimizer's are")
            except BaseException:
                self.param_groups.pop()  # nothing of the refused group stays
                raise
            self._states = LocalState(self.state, self._params())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_profile(cls, name: str, params: Iterable, lr: float = 1e-3,
                     **overrides: Any) -> "ZenFlowOptimizer":
        """An optimizer with the tuned settings of hardware profile ``name``; ``overrides``
        (config fields or betas/eps/weight_decay) win and are validated."""
        from .profiles import load_profile  # lazy: profiles are not needed otherwise

        settings = dict(load_profile(name).settings)
        settings.update(overrides)
        return cls(params, lr=lr, **settings)

    @property
    def backend(self) -> str:
        return self._backend

    def _params(self) -> list[torch.Tensor]:
        """Every param, in state-dict index order."""
        return [p for g in self.param_groups for p in g["params"]]

    def _where(self, p: torch.Tensor) -> tuple[int, int, str | None] | None:
        """(group index, index in the group, the param's name or None), or None for a
        param this optimizer does not hold (a DTensor param's local tensor: its param's)."""
        p = self._owner(p)
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return gi, pi, names[pi] if names else None
        return None

    def _kind(self, p: torch.Tensor) -> str:
        """MATRIX (split by columns) or SMALL (whole on the device): by the whole param's
        shape (a DTensor's global one, so every rank classifies alike), and by name for the
        dense set (``ZenFlowConfig.dense_params``)."""
        where = self._where(p)
        return classify(self._owner(p), self.config, where[2] if where else None)

    def _owner(self, t: torch.Tensor) -> torch.Tensor:
        """The param whose local tensor ``t`` is (FSDP2), else ``t``."""
        states = getattr(self, "_states", None)
        return t if states is None else states.owner(t)

    def _param_name(self, p: torch.Tensor) -> str:
        where = self._where(p)
        if where is None:
            return f"param of shape {tuple(p.shape)}"
        gi, pi, name = where
        label = f"'{name}'" if name else f"param {pi} of group {gi}"
        return f"{label} (shape {tuple(self.param_groups[gi]['params'][pi].shape)}, {p.dtype})"

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; ``closure`` (re-)computes the loss under grad mode first.

        A step is all or nothing: the closure, the checks and the first waits happen before
        anything changes; after that the step finishes, and a KeyboardInterrupt that arrives
        meanwhile (Ctrl-C, or inside a wait for host work) is raised once it has (so
        ``stats()["steps"]`` says whether the interrupted step counts). Anything else that
        raises mid-step leaves the optimizer failed (:class:`OptimizerFailedError`)."""
        self._check_open()
        self._guard.check()
        self._prepared = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = collect(self.param_groups, self._param_name)  # every gradient, validated
        if not self._shard.split_rows:  # FSDP2 may have replaced a param's local tensor
            self._states = LocalState(self.state, self._params())
        work = localize(work, self._param_name)  # FSDP2: this rank's rows
        self._check_hyper()  # a scheduler may have written them
        if not self._worker.alive:  # fail before this step changes anything
            raise HostWorkerError("the host worker thread is dead; the optimizer cannot go on "
                                  "(load a checkpoint into a new optimizer)")
        cfg = self.config
        u = self._global_step + 1 - cfg.warmup_steps
        warmup = u <= 0
        reselect = not warmup and (u - 1) % cfg.effective_select_interval == 0
        boundary = warmup or u % cfg.update_interval == 0
        # The NaN/inf check: read now, or (check_finite_at="boundary", a step that waits for
        # nothing) left on the device to mask this step's update if bad (finite_watch).
        # (a step is steady or reselecting, never both: setup is looked at once at most)
        defer = (cfg.check_finite and self._finite.at_boundary and not (warmup or reselect
                 or boundary) and not self._needs_setup(work))
        moves = None
        if reselect and not self._needs_setup(work):
            # The picks come to the host anyway: the check's flags ride in the same copy,
            # read before anything changes (scoring and picking change nothing).
            moves = self._plan(work, self._global_step + 1 if cfg.check_finite else None)
        elif cfg.check_finite and not defer:
            self._finite.check(work, self._global_step + 1)
        self._prepare_state(work)
        self._guard.before(self._wait_before_step, self._shard.collective, self._global_step)
        if defer:
            self._finite.defer(work, self._global_step + 1, self._undo_of(work))
        with self._guard.whole_step(lambda: self._global_step):
            self._global_step += 1
            if reselect:
                self._reselect(work, moves)
            elif not warmup:
                # A param seen for the first time after a selection boundary selects now
                # (its accumulator is empty and nothing of it is pending).
                fresh = [(g, p, gr) for g, p, gr in work
                         for st in (self._states[p],) if st.get("kind") == MATRIX
                         and not st["selected"] and st["acc_count"] == 0
                         and not st["host_pending"]]
                if fresh:
                    self._select(fresh)
            direct = self._device_half(
                work, single_step_window=boundary and (warmup or cfg.update_interval == 1))
            delay = cfg.effective_apply_delay
            if boundary:
                if cfg.overlap and not warmup:
                    if delay == cfg.update_interval or self._host_pending():
                        self._drain()      # apply the window that ended update_interval ago
                    self._launch_host(direct, apply_now=False)
                else:
                    self._launch_host(direct, apply_now=True, warmup=warmup)
                    self._drain()          # synchronous: apply this window's result now
            elif (cfg.overlap and not warmup and u % cfg.update_interval == delay
                  and self._host_pending()):
                self._drain()              # apply the window that ended apply_delay ago
        return loss

    def _host_pending(self) -> bool:
        """Whether host work is in flight or a host result waits to be applied (the same on
        every rank: both follow the step count)."""
        return self._pipeline.inflight or any(
            isinstance(st, dict) and st.get("host_pending") for st in self.state.values())

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

    def _needs_setup(self, work: Work) -> bool:
        """Whether this step makes or moves a param's state or selects a param's columns for
        the first time (host syncs anyway, and changes that a deferred check could not undo)."""
        for _, p, _ in work:
            st = self._states.get(p)
            if not st or misplaced(p, st) or (st["kind"] == MATRIX and not st["selected"]):
                return True
        return False

    def _undo_of(self, work: Work) -> Callable[[], None]:
        """Puts back the host-side counters a steady step changes (the step count, each
        param's Adam step and window count) as they are now: a deferred NaN/inf check undoes
        the steps it masked (finite_watch)."""
        step = self._global_step
        saved = [(st, {k: st[k] for k in ("step", "device_step", "acc_count") if k in st})
                 for _, p, _ in work for st in (self._states[p],)]

        def undo() -> None:
            self._global_step = step
            for st, counts in saved:
                st.update(counts)
        return undo

    def _prepare_state(self, work: Work) -> None:
        """Every param of the step with its state made or put back where it belongs."""
        for _, p, _ in work:
            st = self._states[p]
            if not st:
                self._states[p] = (init_matrix_state(p, self.link,
                                                     self.config.host_moment_dtype,
                                                     self._shard.rows(p.shape[0]))
                                   if self._kind(p) == MATRIX else init_small_state(p))
            elif misplaced(p, st):
                self._rehome(p, st)
        return work

    def _rehome(self, p: torch.Tensor, st: dict) -> None:
        """Put the host half back in host memory and the device half on the param's device."""
        if self._pipeline.inflight:
            raise RuntimeError(
                f"the optimizer state of {self._param_name(p)} was moved off its devices "
                "while host work was in flight (a framework moved optimizer.state between "
                "steps); the moved copies may miss that work. Move state only after "
                "state_dict()/load_state_dict(), which wait for it")
        rows = self._shard.rows(view2d(p).shape[0]) if st["kind"] == MATRIX else (0, 0)
        self._states[p] = restore_param_state(p, st, self.config, rows)
        self._dev.index_cache.pop(p, None)

    # ------------------------------------------------------------------ selection
    def _reselect(self, work, moves=None) -> None:
        """Drain, then migrate to the picks of this step's gradients (``moves``: planned
        before the step changed anything, see :meth:`_plan`; else planned here)."""
        self._drain()
        self._counters["selection_refreshes"] += 1
        if moves is None:
            self._select(self._matrices(work))
        else:
            self._migrate(moves)

    def _matrices(self, work: Work) -> Work:
        return [w for w in work if self._states[w[1]]["kind"] == MATRIX]

    def _plan(self, work: Work, check_step: int | None) -> list:
        """Score and pick the columns of a reselection (states made and selected before),
        and with ``check_step`` read the NaN/inf check of the step in the picks' copy: one
        host read per device for both; NonFiniteGradientError before any change."""
        flags = {} if check_step is None else self._finite.flags(work)
        moves, reads = plan_selection(self._matrices(work), self._states, self.ops, self.link,
                                      self.config, self._shard, also=flags)
        if check_step is not None:
            self._finite.judge(work, check_step, reads)
        return moves

    def _select(self, items) -> None:
        """Score and pick every param's columns on its device, bring all the picks to the
        host in one copy per device, then migrate (partition.migrate_many): a few host syncs
        per reselection whatever the number of params."""
        self._migrate(plan_selection(items, self._states, self.ops, self.link, self.config,
                                     self._shard))

    def _migrate(self, moves: list) -> None:
        self._counters["columns_migrated"] += migrate_many(
            moves, ops=self.ops, link=self.link, host_idx_on_device=self._dev.index_cache,
            shard=self._shard)

    # ------------------------------------------------------------------ device half
    def _device_half(self, work: Work, single_step_window: bool) -> dict:
        """Every step: AdamW on the device-owned columns and on the small params, and the
        gradient of the host-owned columns into the window accumulator (``DeviceHalf``).
        Returns the host columns of params whose one-step window hands its gradient to the
        host as it is (``single_step_window``: warm-up, update_interval=1)."""
        self._pipeline.wait_copy_in()  # the accumulators are on loan to the job until copied
        direct, to_host = self._dev.run(work, self._states, single_step_window,
                                        self._finite.skip_of)
        if to_host:  # the host worker adds them; this thread only queues the copies
            self._pipeline.accumulate(to_host, f"step {self._global_step}")
        return direct

    # ------------------------------------------------------------------ host half
    def _launch_host(self, direct: dict, apply_now: bool, warmup: bool = False) -> None:
        """Hand every param's window to the host pipeline (one job): what crosses, the
        hyperparameters of this step (host lr times the multiplier), where the result goes.

        ``direct``: the host columns of params whose window is this step alone. ``warmup``:
        a warm-up step, plain AdamW (host lr multiplier 1). ``apply_now``: the caller
        applies this job's result in this step (overlap=False, warm-up); a param whose
        columns are all host-owned is then written by the job itself."""
        windows = [close_window(group, local(p), st, self.config, self._shard, direct,
                                apply_now, warmup, p.shape[0] if is_dtensor(p) else None)
                   for group in self.param_groups for p in group["params"]
                   for st in (self.state.get(p),)
                   if isinstance(st, dict) and st.get("kind") == MATRIX and st["acc_count"]]
        if not windows:
            return
        windows = share_adaptive_sums(windows, self._shard)
        self._counters["host_updates"] += 1
        self._pipeline.launch(windows, apply_now, f"host AdamW of step {self._global_step}")

    def _drain(self) -> None:
        """Wait for host work in flight, then write every pending host result into its param.
        Under data parallelism every rank does this at the same step: the ranks agree that
        their jobs succeeded, then gather each other's rows of the results."""
        self._prepared = None  # what it applies changes the params and the pending state
        failure, self._guard.deferred = self._guard.deferred, None
        try:
            self._pipeline.wait()
        except KeyboardInterrupt:  # outside a step (synchronize, eval): nothing changed yet
            raise
        except BaseException as e:  # every rank must hear of it before the gather
            failure = failure or e
        # Every rank has the same pending params (flags set when the job was launched), so
        # every rank makes the same collective: the gather of the results' rows, which also
        # agrees on the failure (one wait per apply), or the agreement alone.
        pending = [(local(p), st) for p in self._params() for st in (self.state.get(p),)
                   if isinstance(st, dict) and st.get("host_pending")]
        # One process or FSDP2 (each rank writes its own rows): the vote alone, always.
        sharded = self._shard.sharded
        if sharded and failure is not None and pending:
            apply_results(pending, {}, link=self.link, shard=self._shard, ops=self.ops,
                          host_idx=self._dev.host_idx, failure=failure)  # raises
        if not sharded or failure is not None or not pending:
            self._shard.agree(failure, "the host work")
        stored, boxed_keys = self._pipeline.take_results()
        for p in stored:  # the job wrote these params itself
            self._states[p]["host_pending"] = False
        pending = [(p, st) for p, st in pending if st.get("host_pending")]
        if not pending:
            return
        # The job's results, already in each param's dtype: one non-blocking copy per arena
        # (the next job waits for it before it rewrites an outbox: CopyQueue.wait_launched).
        boxed = self._pipeline.results_on_device([p for p, _ in pending if p in boxed_keys])
        apply_results(pending, boxed, link=self.link, shard=self._shard, ops=self.ops,
                      host_idx=self._dev.host_idx)

    # ------------------------------------------------------------------ public helpers
    def synchronize(self) -> None:
        """Finish all host work and apply it to the params now (changes the schedule once:
        the deferred columns skip their staleness; deterministic)."""
        self._check_open()
        self._guard.check()
        if self.config.check_finite:
            self._finite.settle()  # a deferred NaN/inf check raises here, rolled back
        self._guard.or_fail(self._drain, self._global_step)

    def train(self) -> "ZenFlowOptimizer":
        self._training = True
        return self

    def eval(self) -> "ZenFlowOptimizer":
        """Apply pending host results so evaluation sees fully updated weights."""
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
        on each side (``memory``), host staging, and host wait/busy seconds."""
        if getattr(self, "_detached", False):
            self._check_open()
        return dict(steps=self._global_step, backend=self._backend,
                    rank=self._shard.rank, world_size=self._shard.world,
                    collective_bytes=self._shard.bytes,
                    bytes_device_to_host=self.link.bytes_d2h,
                    bytes_host_to_device=self.link.bytes_h2d,
                    device_owned_fraction=device_owned_fraction(self._params(), self.state,
                                                                self._kind),
                    host_staging_bytes=self._pipeline.staging_bytes(),
                    **memory_bytes(self.state, self.config,
                                   [d for _, d in self._dev.index_cache.values()],
                                   self._pipeline, self.link),
                    host_inflight=self._pipeline.inflight,
                    host_lr_multiplier_mean=_mean(self._pipeline.multipliers.values()),
                    **self._all_counters())

    def _all_counters(self) -> dict[str, Any]:
        return dict(self._counters, host_wait_seconds=self._pipeline.wait_seconds,
                    host_busy_seconds=self._pipeline.busy_seconds)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Tensors and primitives only. Host work in flight is finished first and saved as
        pending (``host_pending``), to be applied at the step it would have been anyway.
        Under data parallelism: collective, and the full form (every rank's rows of every
        host half, gathered); :meth:`save_sharded` writes each rank's rows instead. After
        :meth:`prepare_state_dict` (on every rank) and before the next change, the prepared
        state dict, with no collective: one rank may then call this alone."""
        prepared = getattr(self, "_prepared", None)  # a copy (__setstate__) has none
        if prepared is not None and prepared[0] == self._global_step:
            return prepared[1]
        return self._state_dict(gather=True)

    def prepare_state_dict(self) -> None:
        """Gather the full state dict now (collective under data parallelism: every rank
        calls it) and keep it until the next change (step, synchronize, load), so that a
        following :meth:`state_dict` on one rank alone makes no collective. For frameworks
        that save on rank 0 only, such as the HF Trainer (``zenflow_triton.hf.ZenFlowCallback``
        calls this on every rank before a save). A no-op for the collectives on one process."""
        self._prepared = None
        self._prepared = (self._global_step, self._state_dict(gather=True))

    def save_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Save through ``torch.distributed.checkpoint``, each rank writing only its rows of
        the host halves (collective); :meth:`load_sharded` reads it into any world size.
        See ``zenflow_triton.checkpoint``."""
        from .checkpoint.sharded import save_sharded
        save_sharded(self._state_dict(gather=False), self._params(), self._shard,
                     checkpoint_id, **dcp_kwargs)

    def load_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Load a :meth:`save_sharded` checkpoint (collective; any world size)."""
        from .checkpoint.sharded import read_sharded
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
        sd = pack(self.param_groups, self.state)
        if gather and self._shard.sharded:  # the full form: every rank's rows of each host half
            gather_host_halves(sd["state"], self._params(), self._shard)
        sd[SD_KEY] = {"version": SD_VERSION, "global_step": self._global_step,
                      "config": self.config.to_dict(), "backend": self._backend}
        if sd["param_groups"]:  # also where frameworks keep only state and param_groups
            sd["param_groups"][0][SD_KEY] = dict(sd[SD_KEY])  # (DCP's state_dict API)
        if not self._shard.split_rows:
            self._fsdp_state_dict(sd)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _not_under_fsdp2(self, what: str) -> None:
        if not self._shard.split_rows:
            raise NotImplementedError(
                f"{what} is not supported for FSDP2 params yet; save and load through "
                "save_sharded() / load_sharded(), or "
                "torch.distributed.checkpoint.state_dict (get_optimizer_state_dict / "
                "set_optimizer_state_dict), which state_dict() and load_state_dict() serve "
                "(docs/distributed.md)")

    def _fsdp_state_dict(self, sd: dict) -> None:
        """FSDP2: each DTensor param's state as DTensors of its placement (each rank's rows,
        no copies), as ``torch.distributed.checkpoint.state_dict`` expects of an optimizer
        over FSDP2 params; an accumulator even where no window is open (zeros), so that a
        fresh optimizer's state dict, which DCP loads into, has every key of a saved one."""
        params = self._params()
        for i, st in sd["state"].items():
            if not (isinstance(i, int) and isinstance(st, dict) and is_dtensor(params[i])):
                continue
            if st.get("kind") == MATRIX and st.get("acc") is None:
                st["acc"] = torch.zeros(st["host_master"].shape[0], st["host_idx"].numel(),
                                        dtype=self.config.accumulator_torch_dtype)
            sd["state"][i] = state_as_dtensors(st, params[i])

    def _local_state_of(self, p: torch.Tensor, saved: dict) -> tuple[torch.Tensor, dict]:
        """``state_format.read``'s view of a saved state for this rank (FSDP2: its rows)."""
        if not is_dtensor(p):
            return p, saved
        return local(p), state_as_local(saved, p, self._shard.chunk_rows(p.shape[0]))

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW.load_state_dict`` takes it (same
        params and groups): per param one step count, and the moments of both halves, rescaled
        to it so their bias-corrected values are unchanged, in the param's shape. Applies
        pending host results to the params first (as :meth:`synchronize`). Refused while a
        window is open (its accumulated gradient has no place in AdamW's state): call it
        after a step that ends a window. Under data parallelism: collective."""
        open_windows = [self._param_name(p) for p in self._params()
                        if isinstance(self.state.get(p), dict)
                        and self.state[p].get("acc_count", 0) > 0]
        self._not_under_fsdp2("to_adamw_state_dict()")
        if open_windows:
            raise ValueError("to_adamw_state_dict: a window is open (accumulated gradients "
                             f"not yet on the host) for {', '.join(open_windows[:3])}; call "
                             "it after a step that ends a window")
        self.synchronize()
        return adamw_state_dict(self._state_dict(gather=True), self._params())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, or a ``torch.optim.AdamW`` one for the same params and
        groups (switching from AdamW mid-training: its moments become the host half and the
        next step selects the device's columns with theirs; the schedule starts afresh).
        Runs torch's load hooks in torch's order. Every saved tensor is checked against its
        param before anything changes (``state_format.read``). Device state goes to each
        param's device, host state to host memory, index tensors stay int64, whatever device
        or dtype a framework moved them to. Loading a good state clears a failure."""
        self._check_open()
        state_dict = dict(state_dict)  # shallow, as torch does
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        loaded = read(state_dict, self.param_groups, self.config, self._shard.rows,
                      self._param_name, self._kind, self._local_state_of)
        self._check_hyper(loaded.groups, "state_dict param group")
        changed = None if loaded.adamw else config_change(loaded.meta.get("config"),
                                                           self.config)
        if changed:
            warnings.warn(changed, UserWarning, stacklevel=2)
        try:  # the work in flight belongs to the state being replaced, failed or not
            self._pipeline.wait_all()
        except (HostWorkerError, ShardError):
            pass
        self._pipeline.forget()
        for g, saved in zip(self.param_groups, loaded.groups):
            g.update(saved)
        self.state.clear()
        self.state.update(loaded.state)
        self._dev.index_cache.clear()
        self._finite.discard()  # unread checks of the state being replaced
        self._prepared = None
        self._global_step = 0 if loaded.adamw else int(loaded.meta.get("global_step", 0))
        self._guard.clear()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


__all__ = ["ZenFlowOptimizer", "NonFiniteGradientError", "HostWorkerError",
           "OptimizerFailedError"]
