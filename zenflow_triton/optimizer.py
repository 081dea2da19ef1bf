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
  runs AdamW on the host-owned columns at lr times the host multiplier ("auto": the param's
  number of gradients in the window; 1 in warm-up, which is plain AdamW; see
  ``ZenFlowConfig.host_lr_multiplier``). With overlap=True the result is
  written into the param at the next boundary, with overlap=False at once. The apply point is
  fixed by the step count, never by thread timing, so training is bit-for-bit reproducible.

Ordering invariant of the async part: a host job owns, until the optimizer has waited for it
(``_wait_inflight``), the host master/moments of the host-owned columns and the staging
buffers of the window's gradient. It also borrows the window's gradient sources (device
accumulators, or a single-step window's own ``.grad``) until its copy-in is done
(``_wait_copy_in``): the next accumulation waits for that, and a ``.grad`` source is waited
for before ``step()`` returns. A job whose result applies at once (overlap=False, warm-up)
is waited for in the same step, so it may also write the params whose columns are all
host-owned (``_stored_by_job``); a job owns its params' outboxes until waited for
(``_job_outbox``), and the apply's non-blocking copy reads an outbox until the work queued
before the next launch is done, which the next job waits for before it writes one
(``CopyQueue.wait_launched``); everything else (the other params, the device state)
belongs to the main thread. The job's device copies go through a ``transfer.CopyQueue``:
on CUDA a copy stream ordered after what the main thread queued before the launch.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import torch

from .config import ZenFlowConfig
from .host import (HostAdamW, HostHyper, HostJob, HostWorker, HostWorkerError, Outboxes,
                   PieceIO)
from .kernels import (KernelOps, confirm_nonfinite, get_ops, nonfinite_flags,
                      triton_available)
from .partition import (MATRIX, SMALL, Move, classify, init_matrix_state, migrate_many,
                        new_accumulator, num_selected, select_columns, view2d)
from .transfer import Link, host_empty, to_host_memory

_SD_KEY = "zenflow"
_SD_VERSION = 1


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf; raised by step() before any state changes."""


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
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, config: ZenFlowConfig | None = None,
                 **config_fields: Any) -> None:
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
                if classify(p, self.config) == MATRIX and not p.is_contiguous():
                    raise ValueError(f"{self._param_name(p)} is not contiguous; "
                                     "column-split params must be contiguous")
        self._backend = self._resolve_backend()
        self.ops: KernelOps = get_ops(self._backend)
        self.link = Link()
        threads = self.config.host_threads or max(1, torch.get_num_threads())
        self._host_adamw = HostAdamW(threads, self.config.chunk_size, self.config.host_timeout,
                                     cores=self.config.host_cores)
        self._worker = HostWorker(self.config.host_timeout)
        self._inflight: HostJob | None = None
        self._adds: list[HostJob] = []  # accumulate_on="host": add jobs not yet waited for
        self._copy_in: threading.Event | None = None  # set when the job's copy-in is done
        # Gradients of single-step windows, handed to the host in the same step (never
        # kept across steps, so never part of the saved state).
        self._direct: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        # Per-param host buffers for the window gradient, reused across windows (transient:
        # free whenever no host job is in flight, so never saved).
        self._staging: dict[torch.Tensor, torch.Tensor] = {}
        self._host_idx_dev: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stored_by_job: list[torch.Tensor] = []
        # Per-param host buffers in the param's dtype (pinned where CUDA exists) that a
        # deferred job fills with its result piece by piece; the apply copies them as they are.
        self._outboxes = Outboxes()  # per-param views of one pinned arena per dtype
        self._job_outbox: dict[torch.Tensor, torch.Tensor] = {}
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
        self._counters = dict(selection_refreshes=0, host_updates=0, columns_migrated=0,
                              host_wait_seconds=0.0, host_busy_seconds=0.0)

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
        """One optimizer step; ``closure`` (re-)computes the loss under grad mode first."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._direct.clear()
        work = self._collect_grads()  # validates every gradient before any state changes
        if not self._worker.alive:  # fail before this step changes anything
            raise HostWorkerError("the host worker thread is dead; the optimizer cannot go on "
                                  "(load a checkpoint into a new optimizer)")
        self._check_adds()

        self._global_step += 1
        cfg = self.config
        u = self._global_step - cfg.warmup_steps
        warmup = u <= 0
        if not warmup and (u - 1) % cfg.effective_select_interval == 0:
            self._reselect(work)
        elif not warmup:
            # A param seen for the first time after a selection boundary selects now (its
            # accumulator is empty and nothing of it is pending).
            fresh = [(g, p, gr) for g, p, gr in work
                     if self.state[p].get("kind") == MATRIX and not self.state[p]["selected"]
                     and self.state[p]["acc_count"] == 0 and not self.state[p]["host_pending"]]
            if fresh:
                self._select(fresh)

        boundary = warmup or u % cfg.update_interval == 0
        self._device_half(work,
                          single_step_window=boundary and (warmup or cfg.update_interval == 1))

        if boundary:
            if cfg.overlap and not warmup:
                self._drain()          # apply the window that ended update_interval ago
                self._launch_host(apply_now=False)
            else:
                self._launch_host(apply_now=True, warmup=warmup)
                self._drain()          # synchronous: apply this window's result now
        return loss

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
        if self._inflight is not None:
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
            self.state[p] = init_matrix_state(p, self.link, self.config.accumulate_on)
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
            g2d = view2d(g)
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
            moves, ops=self.ops, link=self.link, accumulate_on=self.config.accumulate_on,
            host_idx_on_device=self._host_idx_dev)

    # ------------------------------------------------------------------ device half
    def _device_half(self, work, single_step_window: bool) -> None:
        """Every step: AdamW on the device-owned columns and on the small params, and the
        gradient of the host-owned columns into the window accumulator; one multi-tensor op
        per param group for each (launches grow with groups and dtypes, not params).

        ``single_step_window``: this step is a whole window (warm-up, update_interval=1); a
        param whose window starts here hands its gradient to the host as it is, at launch,
        with no pass through the accumulator (``self._direct``)."""
        self._wait_copy_in()  # the accumulators are the previous job's until it copied them
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
            acc = host_idx = None
            if st["host_idx"].numel():
                g2d = view2d(g)
                host_idx = self._host_idx_on_device(p, st)
                if single_step_window and st["acc_count"] == 0:
                    self._direct[p] = (g2d, host_idx)
                elif acc_on_device:
                    acc = st["acc"]
                else:  # the columns cross the link every step, in the grad's dtype
                    to_host.append((st["acc"], self._host_columns(g2d, host_idx)))
                st["acc_count"] += 1
            if has_dev or acc is not None:
                matrices.append((p, g, st, acc, host_idx))
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
                self.ops.selective_adamw_accumulate(
                    [view2d(p.detach()) for p, *_ in matrices],
                    [view2d(g) for _, g, *_ in matrices],
                    [st["device_idx"] for _, _, st, *_ in matrices],
                    [st["device_m"] for _, _, st, *_ in matrices],
                    [st["device_v"] for _, _, st, *_ in matrices],
                    [st.get("device_master") for _, _, st, *_ in matrices],
                    [st["device_step"] for _, _, st, *_ in matrices],
                    [acc for *_, acc, _ in matrices], [h for *_, h in matrices], **hyper)
        if to_host:
            self._accumulate_on_host(to_host)

    def _accumulate_on_host(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """accumulate_on="host": the host-owned columns of every param cross in one copy per
        device and grad dtype that does not block this thread, and the host worker adds them
        into the accumulators.

        Ordering invariant: the add job captures the accumulator tensors it adds into, and
        the worker runs jobs in submission order, so every add of a window is done before
        that window's host job (submitted later) reads the accumulator; state_dict() and
        load_state_dict() wait for the adds (``_wait_adds``). The device columns are a
        gathered copy, so the caller may overwrite ``.grad`` as soon as step() returns."""
        groups: dict[tuple, list] = {}
        for acc, cols in items:
            groups.setdefault((cols.device, cols.dtype), []).append((acc, cols))
        for members in groups.values():
            flat = torch.cat([cols.reshape(-1) for _, cols in members])
            host, wait = self.link.to_host_async(flat)
            layout = [(acc, cols.shape, cols.numel()) for acc, cols in members]
            timeout = self.config.host_timeout

            def add(host=host, wait=wait, layout=layout) -> None:
                wait(timeout)
                off = 0
                for acc, shape, n in layout:
                    acc.add_(host[off:off + n].view(shape))
                    off += n

            self._adds.append(self._worker.submit(add, f"host accumulation of step "
                                                       f"{self._global_step}"))

    def _wait_adds(self) -> None:
        """Wait for the host accumulation jobs submitted so far (their errors raise here)."""
        adds, self._adds = self._adds, []
        for job in adds:
            self._worker.wait(job)

    def _check_adds(self) -> None:
        """Raise the error of a failed host accumulation job; forget the finished ones."""
        live = []
        for job in self._adds:
            if job.done.is_set():
                self._worker.wait(job)  # returns at once; raises HostWorkerError if it failed
            else:
                live.append(job)
        self._adds = live

    def _host_idx_on_device(self, p: torch.Tensor, st: dict) -> torch.Tensor:
        """``st["host_idx"]`` (kept in host memory) on ``p``'s device, copied once per
        selection instead of every step."""
        cached = self._host_idx_dev.get(p)
        if cached is None or cached[0] is not st["host_idx"]:
            cached = self._host_idx_dev[p] = (st["host_idx"], st["host_idx"].to(p.device))
        return cached[1]

    @staticmethod
    def _reusable(cache: dict, p: torch.Tensor, shape,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``cache[p]``: a host buffer of ``shape`` and ``dtype`` (pinned where CUDA exists),
        reused across windows; reallocated only when a reselection changed the host-owned
        column count. ``self._staging`` holds the window gradients (fp32); the results in the
        params' dtypes go to ``self._outboxes`` (one arena per dtype)."""
        buf = cache.get(p)
        if buf is None or buf.shape != torch.Size(shape):
            buf = cache[p] = host_empty(shape, dtype)
        return buf

    def _host_columns(self, g2d: torch.Tensor, host_idx: torch.Tensor) -> torch.Tensor:
        """g2d[:, host_idx], without a gather when every column is host-owned."""
        if host_idx.numel() == g2d.shape[1]:
            return g2d
        return self.ops.gather_columns(g2d, host_idx)

    # ------------------------------------------------------------------ host half
    def _launch_host(self, apply_now: bool, warmup: bool = False) -> None:
        """Hand every param's window-mean gradient to the host worker (one job).

        ``warmup``: a warm-up step, plain AdamW (host lr multiplier 1).

        ``apply_now``: the caller drains this job at once (overlap=False, warm-up). The job
        then streams: each pool worker loads a piece of the gradient straight from its source
        into its own scratch, updates it, and (for a param whose columns are all host-owned)
        writes the master piece into the param at once, so no full-size staging buffer is
        needed and each piece is copied while it is in cache. Otherwise the job first copies
        every source into a per-param staging buffer, so the sources (device accumulators,
        or a ``.grad``) are free again early, while the host computes. In both modes, where
        the apply needs the result in another dtype or on a CUDA device, each updated master
        piece is cast into a per-param outbox (host, the param's dtype, pinned) while it is in
        cache, so the apply is one plain non-blocking copy; the job waits, before it writes an
        outbox, for the work queued before its launch (the last apply's copies read them).
        """
        assert self._inflight is None, "a host job is still in flight"
        tasks = []
        stage: list[tuple[torch.Tensor, torch.Tensor, bool]] = []  # (host dst, src, zero src)
        stored: list[torch.Tensor] = []  # params whose copy-out the job does
        outboxes: dict[torch.Tensor, torch.Tensor] = {}  # planned once the loop is done
        box_items = []
        devices: set[torch.device] = set()
        queue = None  # the job's CopyQueue, made below once the devices are known

        def piece_load(flat: torch.Tensor, zero: bool):
            def load(s: int, e: int, out: torch.Tensor) -> None:
                queue.copy(out, flat[s:e])
                if zero:
                    queue.zero_(flat[s:e])
            return load

        def piece_store(param_flat: torch.Tensor, master_flat: torch.Tensor):
            def store(s: int, e: int) -> None:
                queue.copy(param_flat[s:e], master_flat[s:e])
            return store

        def outbox_store(p: torch.Tensor, master_flat: torch.Tensor):
            def store(s: int, e: int) -> None:
                queue.wait_launched()  # the last apply's non-blocking copy may still read it
                queue.copy(outboxes[p].view(-1)[s:e], master_flat[s:e])
            return store

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self.state.get(p)
                if not st or st["kind"] != MATRIX or st["acc_count"] == 0:
                    continue
                acc, count = st["acc"], st["acc_count"]
                load = store = None
                if p in self._direct:  # in the grad's dtype over the link, fp32 on the host
                    src, zero_src = self._host_columns(*self._direct.pop(p)), False
                elif self.config.accumulate_on == "device":  # fp32 window sum, once a window
                    src, zero_src = acc, True  # the job zeroes it after the copy
                else:  # host accumulator: the job takes it, the spare becomes the accumulator
                    src = None
                    grad = acc
                    st["acc"] = self._reusable(self._staging, p, acc.shape).zero_()
                    self._staging[p] = acc
                if src is not None:
                    devices.add(src.device)
                    self.link.count_d2h(src.numel() * src.element_size())  # at launch: stats()
                    if apply_now:                                           # never races the job
                        grad, load = None, piece_load(src.reshape(-1), zero_src)
                    else:
                        grad = self._reusable(self._staging, p, src.shape)
                        stage.append((grad, src, zero_src))
                if apply_now and st["host_idx"].numel() == view2d(p).shape[1]:
                    devices.add(p.device)
                    self.link.count_h2d(p.numel() * p.element_size())
                    store = piece_store(p.detach().view(-1), st["host_master"].view(-1))
                    stored.append(p)
                elif p.device.type == "cuda" or p.dtype != torch.float32:
                    # The job's queue must know p's device even when no gradient of p crosses
                    # (accumulate_on="host"): wait_launched() waits for that device's apply.
                    devices.add(p.device)
                    box_items.append((p, st["host_master"].shape, p.dtype, p.device))
                    store = outbox_store(p, st["host_master"].view(-1))
                st["acc_count"] = 0
                st["host_step"] += 1
                st["host_pending"] = True
                scale = self.config.host_lr_multiplier(count, warmup)
                hyper = HostHyper(lr=group["lr"] * scale, beta1=beta1, beta2=beta2,
                                  eps=group["eps"], weight_decay=group["weight_decay"],
                                  step=st["host_step"], grad_divisor=float(count))
                io = PieceIO(load, store) if load or store else None
                tasks.append((st["host_master"], grad, st["host_m"], st["host_v"], hyper)
                             + ((io,) if io else ()))
        if not tasks:
            return
        outboxes.update(self._outboxes.plan(box_items))
        adamw = self._host_adamw
        queue = self.link.copy_queue(devices, self.config.host_timeout)
        copied_in = threading.Event()

        def run() -> None:
            try:  # copy-in first (staged jobs): device -> host staging, then the sources are
                for dst, src, zero_src in stage:  # free again
                    queue.copy(dst, src)
                    if zero_src:
                        queue.zero_(src)
                queue.flush()
            finally:
                if stage:
                    copied_in.set()
            try:
                adamw.update_many(tasks)  # every param of the window in one pool dispatch
                queue.flush()  # streamed jobs: the pieces' zeroing and stores are done
            finally:
                copied_in.set()

        self._counters["host_updates"] += 1
        self._inflight = self._worker.submit(run, f"host AdamW of step {self._global_step}")
        self._copy_in = copied_in
        self._stored_by_job = stored
        self._job_outbox = outboxes
        if any(not zero_src for _, src, zero_src in stage):
            # A param's own .grad: the caller may overwrite it once step() returns.
            self._wait_copy_in()

    def _wait_copy_in(self) -> None:
        """Block until the job in flight has copied its window's gradients off the device
        accumulators (they are on loan to it until then)."""
        if self._copy_in is None:
            return
        t0 = time.perf_counter()
        try:
            self._worker.wait_event(self._copy_in, "the copy-in of the host job in flight")
        finally:
            self._counters["host_wait_seconds"] += time.perf_counter() - t0
        self._copy_in = None

    def _wait_inflight(self) -> None:
        job = self._inflight
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            self._worker.wait(job)
        finally:
            self._counters["host_wait_seconds"] += time.perf_counter() - t0
            if job.done.is_set():
                self._counters["host_busy_seconds"] += job.busy_seconds
                self._inflight = None
                self._copy_in = None

    def _drain(self) -> None:
        """Wait for host work in flight, then write every pending host result into its param."""
        self._wait_inflight()
        for p in self._stored_by_job:  # the job wrote these params itself
            self.state[p]["host_pending"] = False
        self._stored_by_job = []
        outboxes, self._job_outbox = self._job_outbox, {}
        pending = [(p, st) for group in self.param_groups for p in group["params"]
                   for st in (self.state.get(p),) if st and st.get("host_pending")]
        if not pending:
            return
        # The job's results, already in each param's dtype: one non-blocking copy per arena
        # (the next job waits for it before it rewrites an outbox: CopyQueue.wait_launched).
        boxed = self._outboxes.to_device(self.link, [p for p, _ in pending if p in outboxes])
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
        self.ops.scatter_columns_multi([view2d(p.detach()) for p, _ in pending],
                                       [self._host_idx_on_device(p, st) for p, st in pending],
                                       srcs)

    # ------------------------------------------------------------------ public helpers
    def synchronize(self) -> None:
        """Finish all host work and apply it to the params now (changes the schedule once:
        the deferred columns skip their staleness; deterministic)."""
        self._check_open()
        self._drain()

    def train(self) -> "ZenFlowOptimizer":
        self._training = True
        return self

    def eval(self) -> "ZenFlowOptimizer":
        """Apply pending host results so evaluation sees fully updated weights."""
        self._training = False
        if not self._closed:
            self._drain()
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
                    bytes_device_to_host=self.link.bytes_d2h,
                    bytes_host_to_device=self.link.bytes_h2d,
                    device_owned_fraction=dev_elems / total if total else 0.0,
                    host_staging_bytes=sum(b.numel() * b.element_size()
                                           for b in self._staging.values())
                    + self._outboxes.nbytes()
                    + self._host_adamw.scratch_bytes(),
                    host_inflight=self._inflight is not None, **self._counters)

    def close(self) -> None:
        """Stop the host threads (after waiting for work in flight); idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self._inflight is not None:
                self._worker.wait(self._inflight)
        except Exception:  # closing must not raise for a job that already failed
            pass
        finally:
            self._inflight = None
            self._adds = []  # the worker finishes them before it stops
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
        pending (``host_pending``), to be applied at the step it would have been anyway."""
        if getattr(self, "_detached", False):
            self._check_open()  # explains what a copy lacks
        if not self._closed:
            self._wait_inflight()
            self._wait_adds()
        sd = super().state_dict()
        sd["state"] = {i: dict(st) for i, st in sd["state"].items()}
        sd[_SD_KEY] = {"version": _SD_VERSION, "global_step": self._global_step,
                       "config": self.config.to_dict(), "backend": self._backend,
                       "counters": dict(self._counters),
                       "bytes_device_to_host": self.link.bytes_d2h,
                       "bytes_host_to_device": self.link.bytes_h2d}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; device state goes to each param's device, host state to
        (pinned) host memory, index tensors stay int64, whatever device or dtype a framework
        moved them to."""
        self._check_open()
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
        self._wait_inflight()
        self._wait_adds()
        # What the finished job left for its apply belongs to the state being replaced.
        self._stored_by_job, self._job_outbox, self._copy_in = [], {}, None
        self._outboxes.clear_plan()
        self._direct.clear()
        meta = state_dict.get(_SD_KEY, {})
        if meta.get("version", _SD_VERSION) > _SD_VERSION:
            raise ValueError(f"state_dict format version {meta['version']} is newer than this "
                             f"zenflow-triton supports ({_SD_VERSION})")
        id_map = {}
        for g, sg in zip(self.param_groups, saved_groups):
            id_map.update(zip(sg["params"], g["params"]))
            for key, value in sg.items():
                if key not in ("params", "param_names"):
                    g[key] = tuple(value) if key == "betas" else value
        self.state.clear()
        for key, saved in state_dict["state"].items():
            if key not in id_map:
                raise ValueError(f"state_dict has state for param index {key}, which no group "
                                 "holds")
            p = id_map[key]
            self.state[p] = self._restore_param_state(p, saved)
        self._global_step = int(meta.get("global_step", 0))
        self._counters.update(meta.get("counters", {}))
        self.link.bytes_d2h = int(meta.get("bytes_device_to_host", 0))
        self.link.bytes_h2d = int(meta.get("bytes_host_to_device", 0))

    def _restore_param_state(self, p: torch.Tensor, saved: dict) -> dict:
        kind = saved.get("kind")
        if kind not in (MATRIX, SMALL):
            raise ValueError(f"state for {self._param_name(p)} has unknown kind {kind!r}")
        st: dict[str, Any] = {}
        acc_on_host = self.config.accumulate_on == "host"
        for key, value in saved.items():
            if not isinstance(value, torch.Tensor):
                st[key] = value
                continue
            is_idx = key.endswith("_idx")
            dtype = torch.long if is_idx else torch.float32
            if key.startswith("host_") or (key == "acc" and acc_on_host):
                st[key] = to_host_memory(value.to("cpu"), dtype)
            else:
                st[key] = value.to(device=p.device, dtype=dtype, copy=True)
        if kind == MATRIX:
            st["host_idx"] = st["host_idx"].cpu()
            if "acc" not in st:
                st["acc"] = new_accumulator(p.shape[0], st["host_idx"].numel(), p.device,
                                            self.config.accumulate_on)
        return st


def _stop_threads(worker: HostWorker, host_adamw: HostAdamW) -> None:
    """Stop an optimizer's host threads: the worker first (it finishes its queued job, which
    uses the pool), then the pool. Bounded by host_timeout; idempotent."""
    worker.close()
    host_adamw.close()


def _check_hyper(lr, betas, eps, weight_decay, where: str) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError(f"{where}: lr must be a Python float, got a Tensor")
    if not 0.0 <= lr:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two values in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay}")


__all__ = ["ZenFlowOptimizer", "NonFiniteGradientError", "HostWorkerError"]
