"""Gradient streaming (``ZenFlowConfig(stream_grads=True)``): each matrix param's gradient
leaves the device as backward makes it, so no full gradient of the model is ever resident.

A post-accumulate-grad hook per matrix param (in place from construction: the first
backward streams too) splits the gradient as the coming step will use it, then frees
``.grad``:

* *split* (the param has a selection and the coming step neither warms up nor reselects):
  the host-owned columns are gathered and copied to host memory without blocking (a later
  micro-batch's are added into the first's by the adder thread, in the grad's dtype: the sum
  autograd would have made in ``.grad``), the device-owned ones are kept in a device buffer
  ``[rows, k]`` (a later micro-batch's added in place, as autograd adds);
* *whole* (no selection yet, a warm-up step, a reselection step): the whole gradient goes
  to host memory, and where a selection follows, its column scores are added up on the
  device (exact for one micro-batch; with several, the sum of each one's scores).

Nothing is updated inside backward. ``step()`` takes what the hooks left: :meth:`work` gives
its entries (with a NaN/inf probe as their gradient, for the check) and the scores of a
selection, :meth:`norm_of` and :meth:`scale` serve clipping (``max_grad_norm``:
``clipping.Clipper`` scales every gradient by one coefficient), and
:meth:`resolve`, once the step's selection is made, gives the device half the compact device
columns and the host columns (``Split``), which the host worker adds into the window
accumulator, or a one-step window reads as they are. Small params (1-D, tiny matrices) keep
their ``.grad`` as without streaming.

Ordering invariants:

* A host copy is read only after its ``wait``: by the adder's job that adds a later
  micro-batch into the first's (the stream's own thread, ``zenflow-stream``, so that a sum
  never waits behind a window's host AdamW job), on this thread after ``_settle`` (a whole
  gradient in :meth:`resolve`, :meth:`scores`, :meth:`rebase`, :meth:`work`, the summed
  norm), or by the step's finalize job, which :meth:`resolve` queues on the host worker
  before any job that reads the step's host columns (the worker runs jobs in order), and
  which first waits for the adder's jobs of those columns.
* Back-pressure: a hook waits (bounded by ``host_timeout``) for the oldest copies still
  possibly in flight before a new one would make their sources exceed :attr:`copy_bound`
  bytes (the largest streamed matrix's gradient; with the gradient in hand, twice that: what
  ``fit`` counts): on a GPU a copy's source stays allocated until the copy is done, so a
  link slower than backward slows backward down instead of piling gradients up. Likewise
  in host memory: a later micro-batch's copy waits for the adder's oldest sums until the
  copies not yet summed hold at most :attr:`copy_bound` bytes (``fit.host_terms`` counts
  one such copy), so an adder slower than backward does not pile copies up.
* Where the training thread waits for the host copies: a step of several micro-batches with
  ``check_finite`` waits in :meth:`work`, before any change, for the host sums (the adder's
  jobs, each after its copies): a sum of finite micro-batches may overflow, and the step's
  NaN/inf check must know before it changes anything. So does a selection of several
  micro-batches (:meth:`scores`: the summed gradient's scores) and its clipping (the summed
  norm). Otherwise the training thread does not wait for them: the finalize job does.
* What the hooks left is taken by the next ``step()``; ``zero_grad()`` and a step that
  raises NonFiniteGradientError drop it (after its copies are done).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .clipping import scale as scale_tensors, tensor_norms
from ..columns.layout import shape2d, view2d
from .owner import claim, holds, release, take_over
from ..kernels import column_scores_ref, nonfinite_flags
from ..schedule import plan_step
from ..state import MATRIX


class StreamingError(ValueError):
    """Gradient streaming cannot be used with these params or this setup."""


def topology_refusal(settings, *, world: int, fsdp: bool) -> str | None:
    """Why the optimizer refuses ``settings`` (a ``ZenFlowConfig`` or a dict of its fields)
    on ``world`` ranks, FSDP2's params (``fsdp``) or plain ones; None where it takes them.
    The one rule: the constructor (:func:`check_streamable`) and the tuner, which must not
    pick or save what a run on that topology would refuse, both ask it."""
    get = settings.get if isinstance(settings, dict) else (
        lambda k, default=None: getattr(settings, k, default))
    if (world > 1 or fsdp) and get("stream_grads", False):
        return ("stream_grads is not supported under DDP or FSDP2 yet: DDP averages a "
                "gradient across ranks after the hook that would stream it (the hook would "
                "send this rank's own gradient to the host), and FSDP2 holds sharded gradients "
                "this version does not stream; use accumulate_on=\"host\" there")
    return None


def check_streamable(config, shard) -> None:
    """StreamingError, before anything is made, where ``stream_grads`` cannot work."""
    why = topology_refusal(config, world=shard.world, fsdp=not shard.split_rows)
    if why is not None:
        raise StreamingError(why)


@dataclass
class HostPart:
    """A streamed param's host-owned columns of one step, in host memory, in the grad's
    dtype; complete (and clipped) once the step's finalize job ran on the host worker."""
    tensor: torch.Tensor

    def add_into(self, acc: torch.Tensor) -> None:
        """On the host worker: the window accumulator += these columns (as the host
        accumulation of a device gradient adds its copy)."""
        acc.add_(self.tensor.view(acc.shape))


@dataclass
class Split:
    """A streamed param's gradient as the device half takes it."""
    dev: torch.Tensor | None
    """The device-owned columns' gradient [rows, k] on the device (None when k = 0)."""
    host: HostPart | None
    """The host-owned columns (None when every column is device-owned)."""


@dataclass
class _Buffers:
    """What the hooks left for one param since the last step."""
    whole: bool
    host: torch.Tensor | None = None  # the first micro-batch's host copy; later ones add in
    waits: list = field(default_factory=list)  # copies not yet waited for
    jobs: list = field(default_factory=list)   # worker jobs adding later micro-batches
    dev: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    bad: torch.Tensor | None = None            # bool [1] on the device: a NaN/inf seen
    norm: torch.Tensor | None = None           # one micro-batch's 2-norm (clipping)
    micro: int = 0
    host_bad: list = field(default_factory=list)  # the adder's verdicts on the host sum
    rescore: bool = False                      # score from the host copy (not the hooks')


class HostLedger:
    """The host bytes of the copies streaming made (each matrix's host columns of a step, a
    later micro-batch's copy until the adder thread summed it, a whole gradient at a
    selection), from their allocation until their memory is freed; and the most seen at
    once. Thread-safe: a copy may be freed on the host worker or the adder thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` (a new host tensor, not a view) until it is freed; returns it."""
        n = t.numel() * t.element_size()
        if n:
            with self._lock:
                self.live += n
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        with self._lock:
            self.live -= n


class GradStream:
    """The hooks and what they leave (active with ``stream_grads``); also, with or without
    streaming, the peak of live gradient bytes."""

    def __init__(self, config, ops, link, pipeline, device_half, state: dict,
                 next_step: Callable[[], int], name_of: Callable[[torch.Tensor], str],
                 label: str = "a ZenFlowOptimizer") -> None:
        self.config, self.ops, self.link, self.label = config, ops, link, label
        self.pipeline, self.device_half, self.state = pipeline, device_half, state
        self.active = config.stream_grads
        self._next_step, self._name_of = next_step, name_of
        self._bufs: dict[torch.Tensor, _Buffers] = {}
        self._handles: dict[int, Any] = {}  # id(param) -> its hook's handle
        self._coef: torch.Tensor | None = None
        self._held = 0           # device bytes of the buffers kept between hooks
        self.peak_bytes = 0      # live device gradient bytes, the most seen
        self._hook_peak = 0      # the most seen inside a hook (streamed gradients only)
        self.streamed = 0        # gradients streamed (hook calls)
        self._adder = None       # the thread that adds later micro-batches (made when needed)
        self.copy_bound = 0      # device bytes the copies in flight may hold (back-pressure)
        self._in_flight: deque = deque()  # (wait, bytes) of copies not yet waited for here
        self._in_flight_bytes = 0
        self.host = HostLedger()  # the host copies' bytes, held and at most
        self._adding: deque = deque()  # (adder job, bytes) of copies not yet waited for here
        self._adding_bytes = 0

    # ------------------------------------------------------------------ setup
    def install(self, params, kind_of: Callable[[torch.Tensor], str]) -> None:
        """Every trainable matrix param of ``params`` taken over from another open streaming
        optimizer (``owner.take_over``, streaming or not), then, when streaming, a hook
        on each (``check_streamable`` first)."""
        mats = [p for p in params if p.requires_grad and kind_of(p) == MATRIX]
        take_over(self, mats, self._name_of)
        if not self.active:
            return
        this = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:  # the optimizer may be collected: then leave .grad
            stream = this()
            if stream is not None and stream.active and holds(stream, p):
                stream._on_grad(p)
        for p in mats:
            claim(self, p)
            if id(p) not in self._handles:
                self._handles[id(p)] = p.register_post_accumulate_grad_hook(hook)

    def give_up(self, p: torch.Tensor) -> None:
        """Another optimizer takes ``p`` over: this one's hook on it is removed."""
        handle = self._handles.pop(id(p), None)
        if handle is not None:
            handle.remove()
        release(self, p)

    def refuse_grad_scaler(self) -> bool:
        """StreamingError when streaming (``GradScaler.step`` asks this first); else False:
        without streaming the scaler unscales ``.grad`` as for any optimizer."""
        if self.active:
            raise StreamingError(
                "with stream_grads the matrices' gradients leave .grad during backward, so "
                "what reads .grad between backward and step() cannot work on them: GradScaler "
                "(fp16 loss scaling: it unscales and checks .grad; train in bfloat16, no "
                "scaler needed) and a framework's gradient clipping (give the optimizer "
                "max_grad_norm instead and turn the framework's off); or leave stream_grads "
                "off")
        return False

    def remove(self) -> None:
        """Take the hooks off (close()): gradients then stay in ``.grad``; what the hooks
        left since the last step is dropped (with a warning: nothing will step on it), and
        the adder thread stops."""
        if self._bufs:
            warnings.warn(f"ZenFlowOptimizer closed with the gradients of {len(self._bufs)} "
                          "param(s) streamed since the last step(): they are dropped",
                          UserWarning, stacklevel=4)
        self.discard()
        self.active = False
        for h in self._handles.values():
            h.remove()
        self._handles = {}
        release(self)
        if self._adder is not None:
            self._adder.close()

    # ------------------------------------------------------------------ the hook
    def _on_grad(self, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if g.is_sparse or g.layout != torch.strided or g.is_complex() or g.shape != p.shape:
            raise TypeError(f"{self._name_of(p)}: stream_grads takes dense real gradients of "
                            f"the param's shape, got {g.layout} {g.dtype} {tuple(g.shape)}")
        b = self._bufs.get(p)
        if b is None:
            b = self._bufs[p] = self._start(p)
        g2d = view2d(g, like=p)
        transient = g.numel() * g.element_size()
        if self.config.check_finite:
            flag = nonfinite_flags([g2d], exact=True) if g.numel() else None
            if flag is not None:
                b.bad = flag if b.bad is None else b.bad | flag
        if self.config.max_grad_norm is not None:
            b.norm = tensor_norms([g])[0]  # clip_grad_norm_'s per-tensor norm
        if b.whole:
            if b.scores is not None:
                self.ops.column_scores(g2d, self.config.score, out=b.scores)
            host_src = g2d
        else:
            st = self.state[p]
            if st["device_idx"].numel():
                cols = self.ops.gather_columns(g2d, st["device_idx"])
                transient += cols.numel() * cols.element_size()
                if b.dev is None:
                    b.dev = cols
                    self._held += cols.numel() * cols.element_size()
                else:
                    b.dev.add_(cols)
                    if self.config.check_finite:  # finite + finite may overflow
                        flag = nonfinite_flags([b.dev], exact=True)
                        b.bad = flag if b.bad is None else b.bad | flag
            host_src = None
            if st["host_idx"].numel():
                host_src = self.device_half.host_columns(g2d, self.device_half.host_idx(p, st))
                if host_src is not g2d:
                    transient += host_src.numel() * host_src.element_size()
        if host_src is not None:
            self._to_host(b, host_src.contiguous())
        self._hook_peak = max(self._hook_peak, self._held + transient)
        b.micro += 1
        self.streamed += 1
        p.grad = None  # the whole gradient is gone; what the step needs is kept above

    def _start(self, p: torch.Tensor) -> _Buffers:
        """The buffers of ``p``'s gradient for the coming step: split by its selection, or
        whole (with column scores where a selection follows)."""
        plan = plan_step(self._next_step(), self.config)
        st = self.state.get(p)
        unselected = not st or not st.get("selected")
        b = _Buffers(whole=plan.warmup or plan.reselect or unselected)
        self.copy_bound = max(self.copy_bound, p.numel() * p.element_size())
        if b.whole and not plan.warmup:
            b.scores = torch.zeros(shape2d(p)[1], dtype=torch.float32, device=p.device)
            self._held += b.scores.numel() * 4
        return b

    def _to_host(self, b: _Buffers, src: torch.Tensor) -> None:
        """``src`` to host memory without blocking (after :meth:`_make_room`); a later
        micro-batch's added into the first's by the adder thread, after both copies are
        done."""
        nbytes = src.numel() * src.element_size()
        self._make_room(nbytes)
        if b.host is not None:
            self._make_room_to_add(nbytes)
        out, wait = self.link.to_host_async(src)
        self.host.hold(out)
        if nbytes:
            self._in_flight.append((wait, nbytes))
            self._in_flight_bytes += nbytes
        if b.host is None:
            b.host = out.view(src.shape)
            b.waits.append(wait)
            return
        waits, b.waits = b.waits + [wait], []
        timeout, into, add = self.config.host_timeout, b.host, out.view(src.shape)
        verdicts, check = b.host_bad, self.config.check_finite

        def add_micro_batch() -> None:
            for w in waits:
                w(timeout)
            into.add_(add)
            if check:  # finite + finite may overflow: the sum is what the step takes
                verdicts.append(not bool(torch.isfinite(into).all()))
        job = self._adder_thread().submit(add_micro_batch, "a streamed micro-batch's sum")
        b.jobs.append(job)
        self._adding.append((job, nbytes))
        self._adding_bytes += nbytes

    def _make_room_to_add(self, nbytes: int) -> None:
        """Back-pressure on host memory, before a later micro-batch's copy of ``nbytes``:
        wait (bounded) for the adder's oldest sums until the copies it has not summed yet
        and this one hold at most :attr:`copy_bound` bytes (what ``fit.host_terms`` counts
        as a later micro-batch's copy), so an adder slower than backward slows backward
        down instead of piling copies up. A failed sum raises later, where the step
        settles it."""
        while self._adding and self._adding_bytes + nbytes > self.copy_bound:
            job, n = self._adding.popleft()
            self._adder.wait_event(job.done, job.label)
            self._adding_bytes -= n

    def _make_room(self, nbytes: int) -> None:
        """Back-pressure, before a copy of ``nbytes``: wait (bounded) for the oldest copies
        until those possibly still in flight and this one hold at most :attr:`copy_bound`
        bytes of device memory (a copy larger than the bound waits for every one before
        it). A copy another reader already waited for is done: its wait returns at once."""
        while self._in_flight and self._in_flight_bytes + nbytes > self.copy_bound:
            wait, n = self._in_flight.popleft()
            wait(self.config.host_timeout)
            self._in_flight_bytes -= n

    def _adder_thread(self):
        """The thread that sums micro-batches on the host, apart from the host worker (whose
        queue may hold a window's AdamW job: a sum must not wait behind it)."""
        if self._adder is None:
            from ..host.worker import HostWorker
            self._adder = HostWorker(self.config.host_timeout, name="zenflow-stream")
        return self._adder

    # ------------------------------------------------------------------ the step
    @property
    def pending(self) -> bool:
        return bool(self._bufs)

    def work(self, param_groups: list[dict], collected: list) -> list:
        """The step's (group, param, grad) entries, in group order: ``collected`` (the
        ``.grad`` of every param that has one) and, for every param with a streamed gradient,
        a probe: a one-element tensor, NaN where a micro-batch held a NaN or inf, else 0
        (what the NaN/inf check reads; :meth:`resolve` replaces it). With ``check_finite``,
        a param of several micro-batches first waits here, on the training thread, for its
        host sum (its copies, then the adder's addition): the sum's own verdict (it may
        overflow) is part of the probe. Notes the live gradient bytes."""
        if self._bufs:
            have = {p: (group, p, g) for group, p, g in collected}
            out = []
            for group in param_groups:
                for p in group["params"]:
                    b = self._bufs.get(p)
                    if b is not None:
                        if b.jobs and self.config.check_finite:  # the host sum's verdict
                            self._settle(b)  # (the training thread waits: see the module)
                        bad = any(b.host_bad)
                        probe = (torch.full((1,), float("nan") if bad else 0.0,
                                            device=p.device) if b.bad is None or bad
                                 else torch.where(b.bad, float("nan"), 0.0).float())
                        out.append((group, p, probe))
                    elif p in have:
                        out.append(have[p])
            collected = out
        self.note_step(collected)
        return collected

    def checked(self, check: Callable[[], Any], work=()) -> Any:
        """``check()`` (the step's NaN/inf check, before any change). When it raises
        NonFiniteGradientError while streaming, the step is skipped with its whole gradient,
        as a framework's zero_grad would drop it: what the hooks left and the ``.grad`` of the
        small params in ``work`` (set to None). The next backward and step then see only
        their own gradients, with or without a ``zero_grad()`` in between, and not a mix of
        two backward passes (the matrices' dropped, the small params' added up)."""
        try:
            return check()
        except FloatingPointError:
            if self.active:
                for _, p, _ in work:
                    if p not in self._bufs:
                        p.grad = None
            self.discard()
            raise

    def scores(self) -> dict[torch.Tensor, torch.Tensor]:
        """The column scores of the step's gradients, for its selection: the hooks' (one
        micro-batch), or those of the sum of several (scored from the host copy once the
        adder thread summed it, which this thread waits for: a score is not additive over
        micro-batches)."""
        out = {}
        for p, b in self._bufs.items():
            if b.scores is None:
                continue
            if b.micro > 1 or b.rescore:
                self._settle(b)
                b.scores = column_scores_ref(b.host, self.config.score).to(p.device)
                b.rescore = False
                if b.micro > 1:
                    b.norm = None if b.norm is None else self._summed_norm(p, b)
                    b.micro = 1  # scored: the sum is what the step takes
            out[p] = b.scores
        return out

    def norm_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The 2-norm of ``p``'s streamed gradient, for clipping (``clipping.Clipper``): the
        hook's (one micro-batch), or that of the sum of several; None where ``p``'s gradient
        was not streamed."""
        b = self._bufs.get(p)
        if b is None:
            return None
        return b.norm if b.micro == 1 else self._summed_norm(p, b)

    def scale(self, coef: torch.Tensor) -> None:
        """Clipping: the streamed device columns times ``coef`` now; the host columns by the
        host worker (or :meth:`resolve`), by ``coef`` read on the host once a step (the host
        worker must not read a device tensor the training stream is still writing)."""
        scale_tensors([b.dev for b in self._bufs.values() if b.dev is not None], coef)
        self._coef = coef.to("cpu") if self._bufs else None

    def _summed_norm(self, p: torch.Tensor, b: _Buffers) -> torch.Tensor:
        """The 2-norm of a gradient summed over micro-batches, in its dtype as
        ``clip_grad_norm_`` gives it: from the host copy once the host worker summed it (and
        the device columns), the parts' squares added in fp32, rounded once."""
        self._settle(b)
        sq = torch.zeros((), device=p.device)
        for part in (b.host, b.dev):
            if part is not None:
                sq = sq + torch.linalg.vector_norm(part, 2.0, dtype=torch.float32).to(
                    p.device) ** 2
        return sq.sqrt().to((b.host if b.host is not None else b.dev).dtype)

    def _settle(self, b: _Buffers) -> None:
        """Wait (on this thread) until ``b``'s host copy holds every micro-batch."""
        for job in b.jobs:
            self._adder.wait(job)
        for w in b.waits:
            w(self.config.host_timeout)
        b.jobs, b.waits = [], []

    def resolve(self, work) -> tuple[list, dict[torch.Tensor, Split]]:
        """After the step's selection: ``work`` with each streamed entry's probe replaced by
        its device columns' gradient, and param -> :class:`Split` for the device half. Takes
        the buffers (the next backward starts afresh)."""
        bufs, self._bufs, self._held = self._bufs, {}, 0
        coef, self._coef = self._coef, None
        if not bufs:
            return work, {}
        ready: dict[torch.Tensor, Split] = {}
        pending = []
        out = []
        for group, p, g in work:
            b = bufs.get(p)
            if b is None:
                out.append((group, p, g))
                continue
            st = self.state[p]
            if b.whole:  # cut by the selection just made (a reselection, warm-up, first)
                self._settle(b)
                if coef is not None:
                    b.host.mul_(coef.to(b.host.device))
                ready[p] = self._cut(p, st, b.host)
                b.host = None  # the whole gradient goes now, not after every param's cut
            else:
                ready[p] = Split(b.dev, HostPart(b.host) if b.host is not None else None)
                if b.host is not None:
                    pending.append(b)
            out.append((group, p, ready[p].dev if ready[p].dev is not None else g))
        if pending:  # every job that reads these host columns is queued after this one
            self.pipeline.submit(_finalize(pending, coef, self.config.host_timeout,
                                           self._adder), "the streamed gradients of a step")
        return out, ready

    def _cut(self, p: torch.Tensor, st: dict, whole: torch.Tensor) -> Split:
        """A whole gradient in host memory, cut by ``p``'s selection: its device columns
        back on the device, its host columns (a gather on the host)."""
        host_idx = st["host_idx"]
        cols = whole.shape[1]
        dev = None
        if host_idx.numel() < cols:
            dev_idx = np.setdiff1d(np.arange(cols), host_idx.numpy(), assume_unique=True)
            dev = self.link.to_device(whole.index_select(1, torch.from_numpy(dev_idx)),
                                      p.device)
        host = None
        if host_idx.numel():
            host = HostPart(whole if host_idx.numel() == cols
                            else self.host.hold(whole.index_select(1, host_idx)))
        return Split(dev, host)

    def rebase(self) -> None:
        """Before the state is replaced (``load_state_dict``): each split gradient made whole
        again in host memory (its device and host columns put back in place), so the next
        step cuts it by the loaded selection, as it would a ``.grad``."""
        for p, b in self._bufs.items():
            self._settle(b)
            if not b.whole:
                st = self.state[p]
                rows, cols = shape2d(p)
                whole = self.host.hold(torch.empty(
                    rows, cols, dtype=(b.host if b.host is not None else b.dev).dtype))
                if b.host is not None:
                    whole[:, st["host_idx"]] = b.host
                if b.dev is not None:
                    self._held -= b.dev.numel() * b.dev.element_size()
                    whole[:, st["device_idx"].cpu()] = b.dev.cpu()
                b.host, b.dev, b.whole = whole, None, True
            if b.scores is None:
                b.scores = torch.zeros(shape2d(p)[1], dtype=torch.float32, device=p.device)
            b.rescore = True  # whatever the loaded state selects, from this gradient

    def discard(self) -> None:
        """Drop what the hooks left (``zero_grad()``, a step that found a NaN/inf): after
        its copies and jobs are done, so no copy writes freed memory."""
        bufs, self._bufs, self._held, self._coef = self._bufs, {}, 0, None
        for b in bufs.values():
            try:
                self._settle(b)
            except Exception:  # a failed sum: nothing to keep of it
                pass

    # ------------------------------------------------------------------ memory
    def note_step(self, work) -> None:
        """At ``step()``: the ``.grad`` tensors the step reads (every gradient without
        streaming; the small params' with it, added to the most a hook held: a bound) are
        live gradient bytes of this backward."""
        resident = sum(g.numel() * g.element_size() for _, p, g in work
                       if p not in self._bufs)
        self.peak_bytes = max(self.peak_bytes, resident + self._hook_peak)

    def stats(self) -> dict[str, Any]:
        return dict(grad_bytes_peak=self.peak_bytes, grads_streamed=self.streamed,
                    host_streamed_bytes=self.host.live,
                    host_streamed_bytes_peak=self.host.peak)


def _finalize(bufs: list[_Buffers], coef: torch.Tensor | None, timeout: float, adder):
    """The host worker's part of a step's streamed host columns: wait for their copies and
    the adder's sums, then scale them by the clipping coefficient (a host tensor)."""
    waits = [w for b in bufs for w in b.waits]
    jobs = [j for b in bufs for j in b.jobs]
    hosts = [b.host for b in bufs]
    for b in bufs:
        b.waits, b.jobs = [], []

    def run() -> None:
        for w in waits:
            w(timeout)
        for job in jobs:
            adder.wait(job)
        if coef is not None:
            for h in hosts:
                h.mul_(coef)
    return run
