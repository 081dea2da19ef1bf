"""ZenFlowOptimizer: the per-step orchestration (docs/design.md, "The step").

This module decides *when* things happen; ``kernels`` compute, ``host`` runs the host half,
``transfer`` moves and counts bytes, ``partition`` says who owns which columns.

Schedule, with t the global step (1-based) and u = t - warmup_steps:

* t <= warmup_steps: every column of a matrix param is host-owned, and its gradient gets a
  synchronous host AdamW step at once (ZeRO-Offload).
* selection at the start of steps u = 1, 1 + select_interval, ...: drain the host pipeline
  (wait, apply), score the current gradient, migrate the columns that change owner.
* every step: fused AdamW on the device-owned columns and on small params; the gradient of
  the host-owned columns is added to the window accumulator.
* update boundary u % update_interval == 0: the window-mean gradient goes to the host, which
  runs AdamW on the host-owned columns at lr times the host multiplier (for the default
  "sqrt": min(sqrt(n), 2), n the param's number of gradients in the window; 1 in warm-up,
  which is plain AdamW; see ``ZenFlowConfig.host_lr_multiplier``). With overlap=True the result is
  written into the param at the next boundary, with overlap=False at once. The apply point is
  fixed by the step count, never by thread timing, so training is bit-for-bit reproducible.

The host half's buffers, jobs and waits live in ``host.HostPipeline`` (staging, outboxes,
the job in flight, its copy-in, host accumulation), with their ordering invariants written
there; this module only decides when to launch a window, when to wait, and when to apply.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import signal
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .config import ZenFlowConfig
from .host import HostAdamW, HostHyper, HostPipeline, HostWorker, HostWorkerError, Window
from .kernels import (KernelOps, confirm_nonfinite, get_ops, nonfinite_flags,
                      triton_available)
from .partition import (MATRIX, SMALL, Move, classify, init_matrix_state, migrate_many,
                        new_accumulator, num_selected, select_columns, splittable, state_side,
                        view2d)
from .shard import ROW_SHARDED, RowShard, ShardError
from .state_format import (SD_KEY, SD_VERSION, UNSUPPORTED_FLAGS, check_group_flags,
                           check_param_state, from_adamw, is_adamw, pack, to_adamw)
from .transfer import Link, to_host_memory

_SD_KEY = SD_KEY
_SD_VERSION = SD_VERSION


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf; raised by step() before any state changes."""


class OptimizerFailedError(RuntimeError):
    """An earlier step or host job failed, so the state may be partly updated: every later
    step(), state_dict() and synchronize() raises this (the original error is its
    ``__cause__``) until load_state_dict() of a good checkpoint."""


_OPEN: "weakref.WeakSet[ZenFlowOptimizer]" = weakref.WeakSet()


@atexit.register
def _close_open_optimizers() -> None:
    """A script that ends without close() while a host job is in flight would otherwise abort
    the process at exit (a worker thread still inside a torch kernel while the runtime tears
    down). atexit runs before that: wait for the work (bounded) and stop the threads."""
    for opt in list(_OPEN):
        try:
            opt.close()
        except Exception:  # never turn a clean exit into an error
            pass


class ZenFlowOptimizer(torch.optim.Optimizer):
    """AdamW whose important columns update on the device every step and the rest on the host.

    Args:
        params: tensors, ``(name, tensor)`` pairs, or param-group dicts (per-group
            lr / betas / eps / weight_decay), as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: AdamW hyperparameters (decoupled weight decay).
        config: a :class:`ZenFlowConfig`; or give its fields as keywords (not both).
        process_group: data parallelism (DDP: the gradients are averaged before ``step()``):
            the ``torch.distributed`` group whose ranks share the host work, each keeping
            and updating only its rows of every host half (``shard``); None: the default
            group when torch.distributed is initialized, else a single process.
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
        _check_hyper(lr, betas, eps, weight_decay, where="defaults")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        for gi, group in enumerate(self.param_groups):
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                         where=f"param group {gi}")
            for p in group["params"]:
                if p.is_complex():
                    raise TypeError(f"{self._param_name(p)} is complex; ZenFlowOptimizer "
                                    "supports real floating-point params only")
                if not p.is_floating_point():
                    raise TypeError(f"{self._param_name(p)} has dtype {p.dtype}; "
                                    "only floating-point params can be optimized")
                if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ \
                        == "DTensor":
                    raise TypeError(
                        f"{self._param_name(p)} is a DTensor (FSDP2's fully_shard or tensor "
                        "parallelism); ZenFlowOptimizer supports replicated params (DDP) "
                        "only: it shards the host work across ranks itself")
                if classify(p, self.config) == MATRIX and not splittable(p):
                    raise ValueError(
                        f"{self._param_name(p)} has strides {p.stride()}, in which its rows "
                        "(dim 0) are not the outermost dim of a dense layout; column-split "
                        "params need one (contiguous, channels_last, or any 2-D layout); "
                        "raise min_offload_numel to keep it whole on the device")
        self._backend = self._resolve_backend()
        self.ops: KernelOps = get_ops(self._backend)
        self.link = Link()
        self._shard = RowShard(process_group, timeout=self.config.host_timeout)
        threads = self.config.host_threads or max(1, torch.get_num_threads())
        self._host_adamw = HostAdamW(threads, self.config.chunk_size, self.config.host_timeout,
                                     cores=self.config.host_cores)
        self._worker = HostWorker(self.config.host_timeout)
        # The host half's buffers, jobs and waits (staging, outboxes, the job in flight).
        self._pipeline = HostPipeline(self.link, self._host_adamw, self._worker,
                                      self.config.host_timeout)
        self._host_idx_dev: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._empty_halves: dict[tuple, tuple] = {}
        self._deferred_failure: BaseException | None = None  # data parallelism: see step()
        self._failure: BaseException | None = None  # see OptimizerFailedError
        self._failed_at = 0
        self._closed = False
        self._training = True
        self._global_step = 0
        # The threads live as long as this object, not as long as whoever holds a copy of
        # its __dict__: wrappers (Lightning's LightningOptimizer, copy.copy, profilers) share
        # the worker and pool, and collecting such a wrapper must not stop them. A finalizer
        # bound to this object (never __del__, which a wrapper inherits) stops them when the
        # owner is collected, and close() runs it early; it holds the threads, not self.
        self._shutdown = weakref.finalize(self, _stop_threads, self._worker, self._host_adamw)
        self._shutdown.atexit = False  # _close_open_optimizers waits for the work first
        _OPEN.add(self)
        self._counters = dict(selection_refreshes=0, host_updates=0, columns_migrated=0)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, after refusing AdamW options this optimizer does not implement (named)
        and a Tensor lr."""
        where = f"param group {len(getattr(self, 'param_groups', []))}"
        if isinstance(param_group, dict):
            check_group_flags(param_group, where)
            if isinstance(param_group.get("lr"), torch.Tensor):
                raise ValueError(f"{where}: lr as a Tensor is not supported; give a float")
        super().add_param_group(param_group)

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

    def _resolve_backend(self) -> str:
        want = self.config.backend
        on_gpu = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
        if want == "auto":
            return "triton" if on_gpu and triton_available()[0] else "torch"
        if want == "triton":
            ok, why = triton_available()
            if not ok:
                raise RuntimeError(f'backend="triton" requested but {why}')
        return want

    @property
    def backend(self) -> str:
        return self._backend

    def _param_name(self, p: torch.Tensor) -> str:
        for gi, group in enumerate(self.param_groups):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    label = f"'{names[pi]}'" if names else f"param {pi} of group {gi}"
                    return f"{label} (shape {tuple(p.shape)}, {p.dtype})"
        return f"param of shape {tuple(p.shape)}"

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimizer step; ``closure`` (re-)computes the loss under grad mode first.

        A step is all or nothing: what may fail or be interrupted (the closure, the checks,
        the waits for host work) happens before anything changes; after that the step
        finishes, and a KeyboardInterrupt that arrives meanwhile is raised once it has (so
        ``stats()["steps"]`` says whether the interrupted step counts). Anything else that
        raises mid-step leaves the optimizer failed (:class:`OptimizerFailedError`)."""
        self._check_open()
        self._check_healthy()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect_grads()  # validates every gradient before any state changes
        for gi, group in enumerate(self.param_groups):  # a scheduler may have written them
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                         where=f"param group {gi}")
        if not self._worker.alive:  # fail before this step changes anything
            raise HostWorkerError("the host worker thread is dead; the optimizer cannot go on "
                                  "(load a checkpoint into a new optimizer)")
        cfg = self.config
        u = self._global_step + 1 - cfg.warmup_steps
        warmup = u <= 0
        reselect = not warmup and (u - 1) % cfg.effective_select_interval == 0
        boundary = warmup or u % cfg.update_interval == 0
        drains_first = reselect or (boundary and cfg.overlap and not warmup)
        self._wait_before_step(drains_first)
        with self._whole_step():
            self._global_step += 1
            if reselect:
                self._reselect(work)
            elif not warmup:
                # A param seen for the first time after a selection boundary selects now
                # (its accumulator is empty and nothing of it is pending).
                fresh = [(g, p, gr) for g, p, gr in work
                         if self.state[p].get("kind") == MATRIX
                         and not self.state[p]["selected"] and self.state[p]["acc_count"] == 0
                         and not self.state[p]["host_pending"]]
                if fresh:
                    self._select(fresh)
            direct = self._device_half(
                work, single_step_window=boundary and (warmup or cfg.update_interval == 1))
            if boundary:
                if cfg.overlap and not warmup:
                    self._drain()          # apply the window that ended update_interval ago
                    self._launch_host(direct, apply_now=False)
                else:
                    self._launch_host(direct, apply_now=True, warmup=warmup)
                    self._drain()          # synchronous: apply this window's result now
        return loss

    def _wait_before_step(self, drains_first: bool) -> None:
        """The waits of a step that come before any change: a failed host accumulation, the
        copy-in of the accumulators on loan, and, where the step starts by applying the
        window in flight, that job. An interrupt here leaves the optimizer before the step."""
        try:
            self._pipeline.check()  # a failed host accumulation raises before any change
            self._pipeline.wait_copy_in()
            if drains_first:
                self._pipeline.wait()
        except (KeyboardInterrupt, NonFiniteGradientError):
            raise
        except BaseException as e:
            if not self._shard.sharded:
                self._fail(e)
                raise
            # Data parallelism: every rank must hear of it, at the next apply point (where
            # the ranks agree); until then this rank goes on with the others.
            self._deferred_failure = self._deferred_failure or e

    @contextlib.contextmanager
    def _whole_step(self):
        """The changing part of a step: runs to its end. A KeyboardInterrupt (Ctrl-C, or one
        raised inside a wait for host work) is held back and raised after it; any other
        exception leaves the optimizer failed."""
        held: list[BaseException] = []
        restore = _hold_sigint(held)
        self._pipeline.shield = held
        try:
            yield
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self._pipeline.shield = None
            restore()
        if held:
            raise held[0]

    def _fail(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure, self._failed_at = error, self._global_step

    def _check_healthy(self) -> None:
        if self._failure is not None:
            raise OptimizerFailedError(
                f"this ZenFlowOptimizer failed at step {self._failed_at} "
                f"({type(self._failure).__name__}: {self._failure}); its state may be partly "
                "updated, so it refuses to go on or to save: load_state_dict() a good "
                "checkpoint to continue") from self._failure

    def _collect_grads(self) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not p.requires_grad:
                    continue
                if g.is_sparse or g.layout != torch.strided:
                    raise TypeError(f"{self._param_name(p)} has a sparse gradient; "
                                    "ZenFlowOptimizer supports dense gradients only")
                if g.is_complex():
                    raise TypeError(f"{self._param_name(p)} has a complex gradient; "
                                    "ZenFlowOptimizer supports real gradients only")
                if g.shape != p.shape:
                    raise ValueError(f"{self._param_name(p)}: gradient shape "
                                     f"{tuple(g.shape)} does not match the param")
                work.append((group, p, g))
        checked = [(p, g) for _, p, g in work if g.numel()]  # an empty grad is finite
        if self.config.check_finite and checked:
            bad = [self._param_name(p) for (p, _), flag in zip(checked, self._nonfinite(checked))
                   if flag]
            if bad:
                raise NonFiniteGradientError(
                    f"non-finite gradient (NaN or inf) in {', '.join(bad)}; no optimizer state "
                    "was changed by this step (skip it, e.g. with torch.amp.GradScaler, or "
                    "construct with check_finite=False to let it propagate as AdamW does)")
        for _, p, _ in work:
            st = self.state[p]
            if not st:
                self._init_state(p)
            elif self._misplaced(p, st):
                self._rehome(p, st)
        return work

    @staticmethod
    def _misplaced(p: torch.Tensor, st: dict) -> bool:
        """Whether a framework moved this param's state (Lightning moves every state tensor
        to the param's device after loading a checkpoint, and to the CPU at teardown)."""
        if st["kind"] == MATRIX:
            return st["host_master"].device.type != "cpu" or st["device_m"].device != p.device
        return st["exp_avg"].device != p.device

    def _rehome(self, p: torch.Tensor, st: dict) -> None:
        """Put the host half back in host memory and the device half on the param's device."""
        if self._pipeline.inflight:
            raise RuntimeError(
                f"the optimizer state of {self._param_name(p)} was moved off its devices "
                "while host work was in flight (a framework moved optimizer.state between "
                "steps); the moved copies may miss that work. Move state only after "
                "state_dict()/load_state_dict(), which wait for it")
        self.state[p] = self._restore_param_state(p, st)
        self._host_idx_dev.pop(p, None)

    @staticmethod
    def _nonfinite(checked) -> list[bool]:
        """Per gradient, whether it holds a NaN or an inf: one multi-tensor reduction and one
        host read per device (the step's only sync on an ordinary step); a flagged gradient
        is confirmed exactly before it is reported (kernels.finite)."""
        flags = [False] * len(checked)
        by_device: dict[torch.device, list[int]] = {}
        for i, (_, g) in enumerate(checked):
            by_device.setdefault(g.device, []).append(i)
        for idx in by_device.values():
            read = nonfinite_flags([checked[i][1] for i in idx]).tolist()
            for i, flag in zip(idx, read):  # a flag may be an overflow of a finite grad
                flags[i] = flag and confirm_nonfinite(checked[i][1])
        return flags

    def _init_state(self, p: torch.Tensor) -> None:
        if classify(p, self.config) == MATRIX:
            self.state[p] = init_matrix_state(p, self.link, self.config.host_moment_dtype,
                                              self._shard.rows(p.shape[0]))
            return
        st = {"kind": SMALL, "step": 0,
              "exp_avg": torch.zeros_like(p, dtype=torch.float32),
              "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
        if p.dtype != torch.float32:
            st["master"] = p.detach().float().clone()
        self.state[p] = st

    # ------------------------------------------------------------------ selection
    def _reselect(self, work) -> None:
        self._drain()
        self._counters["selection_refreshes"] += 1
        self._select([w for w in work if self.state[w[1]]["kind"] == MATRIX])

    def _select(self, items) -> None:
        """Score and pick every param's columns on its device, bring all the picks to the
        host in one copy per device, then migrate (partition.migrate_many): a few host syncs
        per reselection whatever the number of params."""
        picks: dict[torch.device, list] = {}
        moves = []
        for group, p, g in items:
            g2d = view2d(g, like=p)
            cols = g2d.shape[1]
            k = num_selected(cols, self.config.topk_ratio)
            beta1, beta2 = group["betas"]
            if k in (0, cols):  # nothing to rank
                moves.append(Move(p, self.state[p], np.arange(k, dtype=np.int64), beta1, beta2))
                continue
            idx = select_columns(self.ops.column_scores(g2d, self.config.score), k)
            picks.setdefault(g.device, []).append((p, idx, beta1, beta2))
        for device_picks in picks.values():
            flat = self.link.to_host(torch.cat([idx for _, idx, _, _ in device_picks])).numpy()
            off = 0
            for p, idx, beta1, beta2 in device_picks:
                n = idx.numel()
                moves.append(Move(p, self.state[p], flat[off:off + n], beta1, beta2))
                off += n
        self._counters["columns_migrated"] += migrate_many(
            moves, ops=self.ops, link=self.link, host_idx_on_device=self._host_idx_dev,
            shard=self._shard)

    # ------------------------------------------------------------------ device half
    def _device_half(self, work, single_step_window: bool) -> dict:
        """Every step: AdamW on the device-owned columns and on the small params, and the
        gradient of the host-owned columns into the window accumulator; one multi-tensor op
        per param group for each (launches grow with groups and dtypes, not params).

        ``single_step_window``: this step is a whole window (warm-up, update_interval=1); a
        param whose window starts here hands its gradient to the host as it is, at launch,
        with no pass through the accumulator: returned, ``{param: its host columns}``, for
        this step's launch."""
        self._pipeline.wait_copy_in()  # the accumulators are on loan to the job until copied
        direct: dict[torch.Tensor, torch.Tensor] = {}
        acc_on_device = self.config.accumulate_on == "device"
        to_host: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host acc, device columns)
        by_group: dict[int, tuple[dict, list, list]] = {}
        for group, p, g in work:
            small, matrices = by_group.setdefault(id(group), (group, [], []))[1:]
            st = self.state[p]
            if st["kind"] == SMALL:
                st["step"] += 1
                small.append((p, g, st))
                continue
            has_dev = st["device_idx"].numel() > 0
            if has_dev:
                st["device_step"] += 1
            p2d, g2d = view2d(p.detach()), view2d(g, like=p)
            acc = host_idx = None
            if st["host_idx"].numel():
                host_idx = self._host_idx_on_device(p, st)
                if single_step_window and st["acc_count"] == 0:
                    direct[p] = self._host_columns(g2d, host_idx)
                else:
                    if st["acc"] is None:  # the first window that accumulates makes it
                        # (this rank's rows only, under data parallelism)
                        rows = st["host_master"].shape[0]
                        st["acc"] = new_accumulator(rows, host_idx.numel(),
                                                    p.device, self.config.accumulate_on,
                                                    self.config.accumulator_torch_dtype)
                    if acc_on_device:
                        acc = st["acc"]
                    else:  # this rank's rows cross the link every step, in the grad's dtype
                        r0, r1 = self._shard.rows(g2d.shape[0])
                        to_host.append((st["acc"], self._host_columns(g2d[r0:r1], host_idx)))
                st["acc_count"] += 1
            sliced = acc is not None and acc.shape[0] != p2d.shape[0]  # this rank's rows
            if has_dev or (acc is not None and not sliced):
                matrices.append((p2d, g2d, st["device_idx"], st["device_m"], st["device_v"],
                                 st.get("device_master"), st["device_step"],
                                 None if sliced else acc, None if sliced else host_idx))
            if sliced:  # the accumulation of this rank's rows: an entry with no device columns
                r0, r1 = self._shard.rows(p2d.shape[0])
                none = self._no_columns(p, r1 - r0)
                matrices.append((p2d[r0:r1], g2d[r0:r1], *none, 1, acc, host_idx))
        for group, small, matrices in by_group.values():
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            if small:
                self.ops.adamw([p.detach() for p, _, _ in small], [g for _, g, _ in small],
                               [st["exp_avg"] for _, _, st in small],
                               [st["exp_avg_sq"] for _, _, st in small],
                               [st.get("master") for _, _, st in small],
                               [st["step"] for _, _, st in small], **hyper)
            if matrices:
                self.ops.selective_adamw_accumulate(*map(list, zip(*matrices)), **hyper)
        if to_host:  # the host worker adds them; this thread only queues the copies
            self._pipeline.accumulate(to_host, f"step {self._global_step}")
        return direct

    def _no_columns(self, p: torch.Tensor, rows: int) -> tuple:
        """(index, m, v, master) of no device-owned columns for ``rows`` rows of ``p``: the
        device half of an accumulation-only entry of the multi-tensor op (made once)."""
        key = (p.device, p.dtype, rows)
        made = self._empty_halves.get(key)
        if made is None:
            m = torch.zeros(rows, 0, device=p.device)
            made = self._empty_halves[key] = (
                torch.zeros(0, dtype=torch.long, device=p.device), m, m,
                m if p.dtype != torch.float32 else None)
        return made

    def _host_idx_on_device(self, p: torch.Tensor, st: dict) -> torch.Tensor:
        """``st["host_idx"]`` (kept in host memory) on ``p``'s device, copied once per
        selection (with its migration) instead of every step; here only after a load, by a
        non-blocking copy."""
        cached = self._host_idx_dev.get(p)
        if cached is None or cached[0] is not st["host_idx"]:
            on_device = self.link.indices_to_device(st["host_idx"].numpy(), p.device)
            cached = self._host_idx_dev[p] = (st["host_idx"], on_device)
        return cached[1]

    def _host_columns(self, g2d: torch.Tensor, host_idx: torch.Tensor) -> torch.Tensor:
        """g2d[:, host_idx], without a gather when every column is host-owned."""
        if host_idx.numel() == g2d.shape[1]:
            return g2d
        return self.ops.gather_columns(g2d, host_idx)

    # ------------------------------------------------------------------ host half
    def _launch_host(self, direct: dict, apply_now: bool, warmup: bool = False) -> None:
        """Hand every param's window to the host pipeline (one job): what crosses, the
        hyperparameters of this step (host lr times the multiplier), where the result goes.

        ``direct``: the host columns of params whose window is this step alone. ``warmup``:
        a warm-up step, plain AdamW (host lr multiplier 1). ``apply_now``: the caller
        applies this job's result in this step (overlap=False, warm-up); a param whose
        columns are all host-owned is then written by the job itself."""
        windows = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self.state.get(p)
                if not st or st["kind"] != MATRIX or st["acc_count"] == 0:
                    continue
                count = st["acc_count"]
                if p in direct:  # in the grad's dtype over the link, fp32 on the host
                    source, grad = "direct", direct[p]
                elif self.config.accumulate_on == "device":  # fp32 window sum, once a window
                    source, grad = "device_acc", st["acc"]
                else:
                    source, grad = "host_acc", st["acc"]
                full_host = st["host_idx"].numel() == view2d(p).shape[1]
                sharded = self._shard.sharded  # then every rank's rows meet at the apply
                p2d = view2d(p.detach())
                store_into = (p2d.view(-1) if apply_now and full_host and not sharded
                              and p2d.is_contiguous() else None)
                needs_box = store_into is None and (p.device.type == "cuda"
                                                    or p.dtype != torch.float32)
                st["acc_count"] = 0
                st["host_step"] += 1
                st["host_pending"] = True
                scale = self.config.host_lr_multiplier(count, warmup)
                hyper = HostHyper(lr=group["lr"] * scale, beta1=beta1, beta2=beta2,
                                  eps=group["eps"], weight_decay=group["weight_decay"],
                                  step=st["host_step"], grad_divisor=float(count),
                                  adaptive_window=self.config.adaptive_window(count, warmup))
                rows = (self._shard.rows(view2d(p).shape[0])  # the accumulators hold only
                        if sharded and source == "direct" else None)  # this rank's rows
                windows.append(Window(p, st["host_master"], st["host_m"], st["host_v"], hyper,
                                      source, grad, store_into,
                                      p.detach() if needs_box else None, rows))
        if not windows:
            return
        self._counters["host_updates"] += 1
        self._pipeline.launch(windows, apply_now, f"host AdamW of step {self._global_step}")

    def _drain(self) -> None:
        """Wait for host work in flight, then write every pending host result into its param.
        Under data parallelism every rank does this at the same step: the ranks agree that
        their jobs succeeded, then gather each other's rows of the results."""
        failure, self._deferred_failure = self._deferred_failure, None
        try:
            self._pipeline.wait()
        except KeyboardInterrupt:  # outside a step (synchronize, eval): nothing changed yet
            raise
        except BaseException as e:  # every rank must hear of it before the gather
            failure = failure or e
        self._shard.agree(failure, "the host work")
        stored, boxed_keys = self._pipeline.take_results()
        for p in stored:  # the job wrote these params itself
            self.state[p]["host_pending"] = False
        pending = [(p, st) for group in self.param_groups for p in group["params"]
                   for st in (self.state.get(p),) if st and st.get("host_pending")]
        if not pending:
            return
        # The job's results, already in each param's dtype: one non-blocking copy per arena
        # (the next job waits for it before it rewrites an outbox: CopyQueue.wait_launched).
        boxed = self._pipeline.results_on_device([p for p, _ in pending if p in boxed_keys])
        srcs = []
        for p, st in pending:
            if p in boxed:
                srcs.append(boxed[p])
            elif p.device.type == "cpu" and p.dtype == torch.float32:
                srcs.append(st["host_master"])  # one memory: nothing crosses, nothing waits
                self.link.count_h2d(st["host_master"].numel() * 4)
            else:  # a result loaded from a checkpoint: no outbox yet (once, blocking)
                srcs.append(self.link.to_device(st["host_master"], p.device, dtype=p.dtype))
            st["host_pending"] = False
        # This rank's rows of each result -> all rows, on every rank (as is, unsharded).
        srcs = self._shard.gather_rows(srcs, [view2d(p).shape[0] for p, _ in pending])
        self.ops.scatter_columns_multi([view2d(p.detach()) for p, _ in pending],
                                       [self._host_idx_on_device(p, st) for p, st in pending],
                                       srcs)

    # ------------------------------------------------------------------ public helpers
    def synchronize(self) -> None:
        """Finish all host work and apply it to the params now (changes the schedule once:
        the deferred columns skip their staleness; deterministic)."""
        self._check_open()
        self._check_healthy()
        self._drain_or_fail()

    def _drain_or_fail(self) -> None:
        """:meth:`_drain` outside a step: a failure there leaves the optimizer failed."""
        try:
            self._drain()
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            self._fail(e)
            raise

    def train(self) -> "ZenFlowOptimizer":
        self._training = True
        return self

    def eval(self) -> "ZenFlowOptimizer":
        """Apply pending host results so evaluation sees fully updated weights."""
        self._training = False
        if not self._closed:
            self._check_healthy()
            self._drain_or_fail()
        return self

    @property
    def training(self) -> bool:
        return self._training

    def stats(self) -> dict[str, Any]:
        if getattr(self, "_detached", False):
            self._check_open()
        dev_elems = total = 0
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                total += p.numel()
                st = self.state.get(p)
                if st and st["kind"] == MATRIX:
                    dev_elems += st["device_idx"].numel() * p.shape[0]
                elif classify(p, self.config) == SMALL:
                    dev_elems += p.numel()
        return dict(steps=self._global_step, backend=self._backend,
                    rank=self._shard.rank, world_size=self._shard.world,
                    bytes_device_to_host=self.link.bytes_d2h,
                    bytes_host_to_device=self.link.bytes_h2d,
                    device_owned_fraction=dev_elems / total if total else 0.0,
                    host_staging_bytes=self._pipeline.staging_bytes(),
                    **self._memory_bytes(),
                    host_inflight=self._pipeline.inflight,
                    host_lr_multiplier_mean=_mean(self._pipeline.multipliers.values()),
                    **self._all_counters())

    def _memory_bytes(self) -> dict[str, int]:
        """Bytes of every tensor the optimizer holds, by side: ``device_state_bytes`` (the
        params' side: device-owned state, a device accumulator, index copies),
        ``host_state_bytes`` (host state, staging, outboxes, the workers' scratch, bounce
        buffers) and, of those, ``host_pinned_bytes``: the link buffers, pinned where CUDA
        exists. Each storage counts once, whole, on the side that holds it first (on a
        CPU-only run an index's "device" copy is the host index itself)."""
        seen: set[int] = set()
        out = dict(device_state_bytes=0, host_state_bytes=0, host_pinned_bytes=0)

        def add(side: str, t, link_buffer: bool = False) -> None:
            if not isinstance(t, torch.Tensor):
                return
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                return
            seen.add(key)
            out[f"{side}_state_bytes"] += storage.nbytes()
            if link_buffer:
                out["host_pinned_bytes"] += storage.nbytes()

        for st in self.state.values():
            for key, value in (st.items() if isinstance(st, dict) else ()):
                if isinstance(value, torch.Tensor):
                    add(state_side(key, self.config.accumulate_on), value)
        for _, on_device in self._host_idx_dev.values():
            add("device", on_device)
        for buf, crosses in self._pipeline.host_buffers():
            add("host", buf, link_buffer=crosses)
        pinned_scratch, pageable_scratch = self._pipeline.scratch_bytes()
        fixed = pinned_scratch + self.link.bounce_bytes()
        out["host_state_bytes"] += fixed + pageable_scratch
        out["host_pinned_bytes"] += fixed
        return out

    def _all_counters(self) -> dict[str, Any]:
        return dict(self._counters, host_wait_seconds=self._pipeline.wait_seconds,
                    host_busy_seconds=self._pipeline.busy_seconds)

    def close(self) -> None:
        """Stop the host threads (after waiting for work in flight); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._pipeline.wait()
        except Exception:  # closing must not raise for a job that already failed
            pass
        finally:
            self._pipeline.abandon()  # the worker finishes queued jobs before it stops
            self._shutdown()

    def __enter__(self) -> "ZenFlowOptimizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """copy.copy, copy.deepcopy and pickle keep torch's part of an optimizer only
        (defaults, state, param_groups): no host threads, no step count, no pending work. Such
        a copy is inert: it refuses to step or save, saying so, instead of failing later."""
        super().__setstate__(state)
        self._closed = True
        self._detached = True
        self._training = True

    def _check_open(self) -> None:
        if getattr(self, "_detached", False):
            raise RuntimeError(
                "this ZenFlowOptimizer is a copy made by copy/deepcopy/pickle, which keep only "
                "its param_groups and state (no host threads, step count or pending host "
                "work); to duplicate or move one, build a new ZenFlowOptimizer and call "
                "load_state_dict(old.state_dict())")
        if self._closed:
            raise RuntimeError("this ZenFlowOptimizer is closed")

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Tensors and primitives only. Host work in flight is finished first and saved as
        pending (``host_pending``), to be applied at the step it would have been anyway.
        Under data parallelism: collective, and the full form (every rank's rows of every
        host half, gathered); :meth:`save_sharded` writes each rank's rows instead."""
        return self._state_dict(gather=True)

    def save_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Save through ``torch.distributed.checkpoint``, each rank writing only its rows of
        the host halves (collective); :meth:`load_sharded` reads it into any world size.
        See ``zenflow_triton.checkpoint``."""
        from .checkpoint import save_sharded
        save_sharded(self, checkpoint_id, **dcp_kwargs)

    def load_sharded(self, checkpoint_id, **dcp_kwargs: Any) -> None:
        """Load a :meth:`save_sharded` checkpoint (collective; any world size)."""
        from .checkpoint import load_sharded
        load_sharded(self, checkpoint_id, **dcp_kwargs)

    def _state_dict(self, gather: bool) -> dict[str, Any]:
        """torch's state_dict (its pre and post hooks in its order) plus the ``zenflow``
        entry; host work in flight finished first. No telemetry: identical runs give
        identical state dicts (``stats()`` has the counters and timings)."""
        if getattr(self, "_detached", False):
            self._check_open()  # explains what a copy lacks
        self._check_healthy()
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if not self._closed:
            try:
                self._pipeline.wait_all()
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                self._fail(e)
                raise
        sd = pack(self.param_groups, self.state)
        if gather and self._shard.sharded:  # the full form: every rank's rows of each host half
            self._gather_host_halves(sd["state"])
        sd[_SD_KEY] = {"version": _SD_VERSION, "global_step": self._global_step,
                       "config": self.config.to_dict(), "backend": self._backend}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as ``torch.optim.AdamW.load_state_dict`` takes it (same
        params and groups): per param one step count, and the moments of both halves, rescaled
        to it so their bias-corrected values are unchanged, in the param's shape. Applies
        pending host results to the params first (as :meth:`synchronize`). Refused while a
        window is open (its accumulated gradient has no place in AdamW's state): call it
        after a step that ends a window. Under data parallelism: collective."""
        open_windows = [self._param_name(p) for g in self.param_groups for p in g["params"]
                        if isinstance(self.state.get(p), dict)
                        and self.state[p].get("acc_count", 0) > 0]
        if open_windows:
            raise ValueError("to_adamw_state_dict: a window is open (accumulated gradients "
                             f"not yet on the host) for {', '.join(open_windows[:3])}; call "
                             "it after a step that ends a window")
        self.synchronize()
        sd = self._state_dict(gather=True)
        params = [p for g in self.param_groups for p in g["params"]]
        betas = {i: g["betas"] for g in sd["param_groups"] for i in g["params"]}
        defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
        groups = []
        for g in sd["param_groups"]:
            packed = {**{k: v for k, v in defaults.items() if k not in g}, **g}
            groups.append(packed)
        state = {i: to_adamw(params[i], st, *betas[i]) for i, st in sd["state"].items()
                 if isinstance(i, int) and isinstance(st, dict) and "kind" in st}
        return {"state": state, "param_groups": groups}

    def _gather_host_halves(self, state: dict) -> None:
        """In ``state`` (a state_dict's, keyed by param index), replace each host half that
        holds this rank's rows by all the rows, gathered from every rank (one all-gather per
        dtype; every rank gets the full form, which loads into any world size)."""
        params = [p for g in self.param_groups for p in g["params"]]
        items = [(i, key) for i, st in sorted((i, st) for i, st in state.items()
                                              if isinstance(i, int) and isinstance(st, dict))
                 if st.get("kind") == MATRIX
                 for key in ROW_SHARDED if isinstance(st.get(key), torch.Tensor)]
        full = self._shard.gather_rows([state[i][key].to(self._shard.device) for i, key in items],
                                       [view2d(params[i]).shape[0] for i, _ in items])
        for (i, key), t in zip(items, full):
            state[i][key] = t.cpu()

    # Fields that change how, not what, is computed (results are bit-identical across them).
    _EXECUTION_ONLY = frozenset({"chunk_size", "host_threads", "host_cores", "backend",
                                 "host_timeout", "check_finite"})

    def _warn_config_change(self, saved: Any) -> None:
        """This optimizer keeps its own config on load, as torch optimizers keep their
        constructor's; a resumed run whose schedule or step rule differs from the saved one
        (say, after a library default changed) is worth a warning that names the fields."""
        if not isinstance(saved, dict):
            return
        mine = json.loads(json.dumps(self.config.to_dict()))
        saved = json.loads(json.dumps(saved))
        changed = sorted(k for k in saved.keys() & mine.keys()
                         if k not in self._EXECUTION_ONLY and saved[k] != mine[k])
        if changed:
            what = ", ".join(f"{k}: {saved[k]!r} -> {mine[k]!r}" for k in changed)
            warnings.warn(f"load_state_dict: the state was saved with a different ZenFlowConfig "
                          f"({what}); this optimizer continues with its own. Pass the saved "
                          "values to the constructor to continue the saved run unchanged.",
                          UserWarning, stacklevel=3)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``, or a ``torch.optim.AdamW`` one for the same params and
        groups (switching from AdamW mid-training: its moments become the host half and the
        next step selects the device's columns with theirs; the schedule starts afresh).
        Runs torch's load hooks in torch's order. Every saved tensor is checked against its
        param before anything changes. Device state goes to each param's device, host state
        to (pinned) host memory, index tensors stay int64, whatever device or dtype a
        framework moved them to. Loading a good state clears a failure."""
        self._check_open()
        state_dict = dict(state_dict)  # shallow, as torch does
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("not an optimizer state_dict: missing 'state' or 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups, this "
                             f"optimizer has {len(self.param_groups)}")
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"param group {gi}: state_dict has {len(sg['params'])} "
                                 f"params, this optimizer has {len(g['params'])}")
        adamw = is_adamw(state_dict)
        for gi, sg in enumerate(saved_groups):
            check_group_flags(sg, f"state_dict param group {gi}")
            _check_hyper(sg["lr"], sg["betas"], sg["eps"], sg["weight_decay"],
                         where=f"state_dict param group {gi}")
        meta = state_dict.get(_SD_KEY, {})
        if meta.get("version", _SD_VERSION) > _SD_VERSION:
            raise ValueError(f"state_dict format version {meta['version']} is newer than this "
                             f"zenflow-triton supports ({_SD_VERSION})")
        id_map = {}
        for g, sg in zip(self.param_groups, saved_groups):
            id_map.update(zip(sg["params"], g["params"]))
        # Everything is checked and built before anything of this optimizer changes.
        new_state: dict[Any, Any] = {}
        for key, saved in state_dict["state"].items():
            if key not in id_map:
                new_state[key] = saved  # not a param's: kept as it is (as torch does)
                continue
            p = id_map[key]
            kind = classify(p, self.config)
            label = self._param_name(p)
            if adamw:
                saved = from_adamw(p, saved, kind, self._shard.rows(view2d(p).shape[0]),
                                   label)
            rows = view2d(p).shape[0] if kind == MATRIX else 0
            r0, r1 = self._shard.rows(rows)
            check_param_state(label, p, saved, kind, r1 - r0)
            new_state[p] = self._restore_param_state(p, saved)
        if not adamw:
            self._warn_config_change(meta.get("config"))
        self._finish_replaced_work()
        for g, sg in zip(self.param_groups, saved_groups):
            for key, value in sg.items():
                if key == "params" or (adamw and (key in UNSUPPORTED_FLAGS
                                                  or key == "decoupled_weight_decay")):
                    continue
                g[key] = tuple(value) if key == "betas" else value
        self.state.clear()
        self.state.update(new_state)
        self._host_idx_dev.clear()
        self._global_step = 0 if adamw else int(meta.get("global_step", 0))
        self._failure, self._deferred_failure = None, None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _finish_replaced_work(self) -> None:
        """Before a load replaces the state: wait for host work in flight (its failure, if
        any, belongs to the state being replaced), then drop what it left for its apply."""
        try:
            self._pipeline.wait_all()
        except (HostWorkerError, ShardError):
            pass  # the failed work's state is being replaced
        self._pipeline.forget()

    def _own_rows(self, p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a saved host half or accumulator (checked to be all rows, a
        full form, which is sliced, or exactly this rank's rows)."""
        total = view2d(p).shape[0]
        r0, r1 = self._shard.rows(total)
        return value[r0:r1] if value.shape[0] == total else value

    def _restore_param_state(self, p: torch.Tensor, saved: dict) -> dict:
        kind = saved["kind"]
        st: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "acc" and int(saved.get("acc_count", 0)) == 0:
                continue  # no open window: no accumulator to hold (made when one opens)
            if key in ("step", "device_step", "host_step", "acc_count") \
                    and isinstance(value, torch.Tensor):
                value = int(value.item())
            if not isinstance(value, torch.Tensor):
                st[key] = value
                continue
            if kind == MATRIX and key in ROW_SHARDED:
                value = self._own_rows(p, key, value)  # this rank's rows of a full form
            is_idx = key.endswith("_idx")
            dtype = (torch.long if is_idx
                     else self.config.host_moment_dtype if key in ("host_m", "host_v")
                     else self.config.accumulator_torch_dtype if key == "acc"
                     else torch.float32)
            if state_side(key, self.config.accumulate_on) == "host":
                st[key] = to_host_memory(value.detach(), dtype)  # straight to host memory
            else:
                st[key] = value.detach().to(device=p.device, dtype=dtype, copy=True)
        if kind == MATRIX:
            st["host_idx"] = st["host_idx"].cpu()
            if st.get("acc_count", 0) == 0:
                st["acc"] = None
        return st


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def _hold_sigint(held: list[BaseException]):
    """Until the returned function is called, Ctrl-C appends a KeyboardInterrupt to ``held``
    instead of raising it wherever the main thread is. Only where Python's own handler is in
    place and on the main thread; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return lambda: None
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(KeyboardInterrupt()))
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        return lambda: None
    return lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def _stop_threads(worker: HostWorker, host_adamw: HostAdamW) -> None:
    """Stop an optimizer's host threads: the worker first (it finishes its queued job, which
    uses the pool), then the pool. Bounded by host_timeout; idempotent."""
    worker.close()
    host_adamw.close()


def _check_hyper(lr, betas, eps, weight_decay, where: str) -> None:
    if isinstance(lr, torch.Tensor):  # torch's AdamW without fused/capturable says the same
        raise ValueError(f"{where}: lr as a Tensor is not supported; give a float")
    if not 0.0 <= lr:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two values in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay}")


__all__ = ["ZenFlowOptimizer", "NonFiniteGradientError", "HostWorkerError",
           "OptimizerFailedError"]
