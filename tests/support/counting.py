"""Counting on CPU what a GPU step would cost the host: blocking calls and launches.

``count_step(opt)`` runs ``opt.step()`` and returns a :class:`StepCounts`:

* ``syncs``: host-blocking calls made from the library's own code (``zenflow_triton/``) on
  the thread that steps, as a GPU would see them:

  - every read of a tensor's value into Python (``.item()``, ``bool``/``float``/``int``/index
    of a tensor, all dispatched as ``_local_scalar_dense``), every op whose output size
    depends on the data (``nonzero``, ``masked_select``, ``unique``) or that returns a
    Python value (``equal``);
  - every ``.tolist()`` and ``.cpu()`` (whatever the tensor: an upper bound);
  - every ``Tensor.to(...)`` whose target is the host and every ``Tensor.copy_`` into host
    memory, from a *device* tensor, not marked ``non_blocking``. A device tensor is one on
    a non-CPU device or, on a CPU-only run (where "device" is the params' side, by role),
    one whose memory is a param's, a gradient's or device-side optimizer state
    (``state.state_side``), or the result of an op on the stepping thread that read
    such a tensor (a ``.to(dtype)`` of a gradient, a ``cat`` of its columns);
  - every ``torch.tensor(..., device=...)`` with a non-CPU device (a host-to-device copy
    from pageable memory);
  - every ``torch.cuda.synchronize()``, ``torch.cuda.Stream.synchronize`` and
    ``torch.cuda.Event.synchronize``, and the library's polling wait on a CUDA event
    (``transfer.wait_event``);
  - every wait on the host worker (``HostWorker.wait`` and ``HostWorker.wait_event``),
    whether or not the job is done yet: on CPU and on a GPU alike a step waits for host
    work there, and whether it still runs is a matter of timing;
  - the blocking transfers the library's ``Link`` counted (``Link.to_host``, blocking
    ``Link.to_device``).

  A counted call counts once: what it does inside (``HostWorker.wait`` calls
  ``wait_event``, ``Link.to_host`` copies) is not counted again; the copies the ``Link``
  makes inside its non-blocking transfers (``to_host_async``, ``to_device_async``,
  ``copy_in``, ``indices_to_device``), which on a CPU-only run are plain copies made at once,
  are the Link's to count, as non-blocking. On a CPU run host-side bookkeeping counts too
  (a ``.cpu()`` of a host tensor, the wait for a copy-in that the host worker makes from
  CPU sources), so this is an upper bound of what a GPU would wait for.
* ``ops``: work-launching ops dispatched on the calling thread (aten and custom ops,
  views and metadata ops excluded: they launch nothing) plus the Triton kernels the
  library's launchers launched (``kernels._launch.LAUNCHES``).

The host worker's own threads are not counted: their copies and kernels run beside the
training stream, never in front of it.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

import zenflow_triton
from zenflow_triton import transfer
from zenflow_triton.host.worker import HostWorker
from zenflow_triton.kernels import _launch

_LIB = os.path.dirname(zenflow_triton.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)

_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
             "aten::equal", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
             "aten::is_nonzero"}
_FREE_OPS = {"aten::detach", "aten::lift_fresh", "aten::alias", "aten::view", "aten::_unsafe_view",
             "profiler::_record_function_enter_new", "profiler::_record_function_exit"}
# The Link's own transfers: counted by the Link (blocking or not), their insides not again.
_LINK_METHODS = ("to_host", "to_device", "to_host_async", "to_device_async",
                 "indices_to_device", "copy_in")
BLOCKING_LINK = "a blocking transfer (Link)"


def _from_library() -> str | None:
    """The library frame (file:line) that made the current call, if the nearest frame outside
    torch and this module is the library's."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH) or os.path.abspath(name) == _HERE):
            return f"{os.path.relpath(name, _LIB)}:{f.f_lineno}" if name.startswith(_LIB) else None
        f = f.f_back
    return None


@dataclass
class StepCounts:
    syncs: int = 0
    ops: int = 0
    sync_sites: list[str] = field(default_factory=list)
    op_names: "dict[str, int]" = field(default_factory=dict)

    def kinds(self) -> "dict[str, int]":
        """The syncs by kind: each site's text before " at " (``.tolist()``,
        ``HostWorker.wait``, ``aten::_local_scalar_dense``, ...)."""
        out: dict[str, int] = {}
        for site in self.sync_sites:
            kind = site.split(" at ")[0]
            out[kind] = out.get(kind, 0) + 1
        return out


class _DeviceMemory:
    """Which tensors are the device's: on a non-CPU device, or (CPU-only run) sharing memory
    with a tensor marked as device memory. Marked tensors are kept alive while counting, so
    their addresses are not reused by host tensors meanwhile."""

    def __init__(self) -> None:
        self._ptrs: set[int] = set()
        self._keep: list[torch.Tensor] = []

    @staticmethod
    def _ptr(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a subclass, meta)
            return 0

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            ptr = self._ptr(t)
            if ptr:
                self._ptrs.add(ptr)
                self._keep.append(t)

    def holds(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type != "cpu":
            return True
        return bool(self._ptrs) and self._ptr(t) in self._ptrs


def _is_cpu(device) -> bool:
    if isinstance(device, torch.Tensor):
        device = device.device
    if isinstance(device, int):
        return False  # a CUDA ordinal
    return torch.device(device).type == "cpu"


def _to_target(args, kwargs):
    """``Tensor.to``'s arguments: (target device, or a tensor whose device it is, or None;
    non_blocking)."""
    target, non_blocking = kwargs.get("device"), kwargs.get("non_blocking")
    if args:
        first = args[0]
        if isinstance(first, (str, torch.device, int)) and not isinstance(first, bool):
            target = first
            if len(args) > 2:
                non_blocking = args[2]
        elif isinstance(first, torch.Tensor):
            target = first
            if len(args) > 1:
                non_blocking = args[1]
        elif len(args) > 1:  # to(dtype, non_blocking, ...)
            non_blocking = args[1]
    return target, bool(non_blocking)


class _Mode(TorchDispatchMode):
    def __init__(self, owner: "counting") -> None:
        super().__init__()
        self.owner = owner
        self.counts = owner.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        owner = self.owner
        if name in _SYNC_OPS and not owner._depth:
            site = _from_library()
            if site is not None:
                owner._add(f"{name} at {site}")
        if not func.is_view and name not in _FREE_OPS:
            self.counts.ops += 1
            self.counts.op_names[name] = self.counts.op_names.get(name, 0) + 1
        out = func(*args, **kwargs)
        # Device memory spreads to what an op computes from it (not through a copy into an
        # existing tensor, nor a copy made to the host).
        mem = owner.device_memory
        if mem._ptrs and name != "aten::copy_" and not (
                name == "aten::_to_copy" and kwargs.get("device") is not None
                and _is_cpu(kwargs["device"])):
            if any(mem.holds(a) for a in tree_leaves((args, kwargs))):
                for o in tree_leaves(out):
                    mem.mark(o)
        return out


class counting:
    """``with counting(link) as c:`` counts what runs inside on this thread into ``c`` (a
    StepCounts). ``device_tensors``: on a CPU-only run, the tensors that stand for device
    memory (``count_step`` passes the params, their gradients and the device-side state)."""

    def __init__(self, link, device_tensors=()) -> None:
        self.link = link
        self.counts = StepCounts()
        self.device_memory = _DeviceMemory()
        for t in device_tensors:
            self.device_memory.mark(t)
        self._thread = threading.get_ident()
        self._depth = 0  # > 0 inside a counted call (or a Link transfer): not counted again
        self._patches: list[tuple[object, str, object, bool]] = []

    # -------------------------------------------------------------- helpers
    def _add(self, site: str) -> None:
        self.counts.syncs += 1
        self.counts.sync_sites.append(site)

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _patch(self, owner, name: str, make) -> None:
        real = getattr(owner, name)
        self._patches.append((owner, name, real, name in vars(owner)))
        setattr(owner, name, make(real))

    def _counted(self, label: str, blocks=lambda *a, **k: True):
        """A wrapper of ``real`` that counts a call from library code on this thread as one
        sync labelled ``label`` when ``blocks(*args, **kwargs)``; calls inside it are not
        counted again."""
        def make(real):
            def wrapper(*a, **k):
                if not self._mine() or self._depth:
                    return real(*a, **k)
                site = _from_library()
                if site is not None and blocks(*a, **k):
                    self._add(f"{label} at {site}")
                return self._nested(real, a, k)
            return wrapper
        return make

    def _nested(self, real, a, k):
        """``real(*a, **k)`` with counting off inside it (a counted call counts once)."""
        self._depth += 1
        try:
            return real(*a, **k)
        finally:
            self._depth -= 1

    def _quiet(self, real):
        """A Link transfer: the Link counts it; nothing inside it is counted again."""
        def wrapper(*a, **k):
            if not self._mine():
                return real(*a, **k)
            return self._nested(real, a, k)
        return wrapper

    def _to_blocks(self, tensor, *a, **k) -> bool:
        target, non_blocking = _to_target(a, k)
        if target is None or non_blocking or not _is_cpu(target):
            return False
        if isinstance(target, torch.Tensor) and self.device_memory.holds(target):
            return False  # like a device tensor: not a copy to the host
        return self.device_memory.holds(tensor)

    def _copy_blocks(self, dst, src, non_blocking=False, **k) -> bool:
        return (not non_blocking and isinstance(dst, torch.Tensor) and dst.device.type == "cpu"
                and not self.device_memory.holds(dst) and self.device_memory.holds(src))

    @staticmethod
    def _tensor_blocks(*a, device=None, **k) -> bool:
        return device is not None and not _is_cpu(device)

    # -------------------------------------------------------------- the context
    def __enter__(self) -> StepCounts:
        self._blocking0 = self.link.blocking_transfers
        self._launches0 = sum(_launch.LAUNCHES.values())
        T = torch.Tensor
        self._patch(T, "tolist", self._counted(".tolist()"))
        self._patch(T, "cpu", self._counted(".cpu()"))
        self._patch(T, "to", self._counted(".to(host)", self._to_blocks))
        self._patch(T, "copy_", self._counted(".copy_(host <- device)", self._copy_blocks))
        self._patch(torch, "tensor", self._counted("torch.tensor(device=...)",
                                                   self._tensor_blocks))
        if isinstance(getattr(torch, "cuda", None), type(torch)):
            self._patch(torch.cuda, "synchronize", self._counted("torch.cuda.synchronize"))
            for cls in ("Stream", "Event"):
                if hasattr(getattr(torch.cuda, cls, None), "synchronize"):
                    self._patch(getattr(torch.cuda, cls), "synchronize",
                                self._counted(f"torch.cuda.{cls}.synchronize"))
        self._patch(transfer, "wait_event", self._counted("transfer.wait_event"))
        self._patch(HostWorker, "wait", self._counted("HostWorker.wait"))
        self._patch(HostWorker, "wait_event", self._counted("HostWorker.wait_event"))
        for m in _LINK_METHODS:
            self._patch(transfer.Link, m, self._quiet)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self.counts

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for owner, name, real, own in reversed(self._patches):
            if own:
                setattr(owner, name, real)
            else:
                delattr(owner, name)
        self._patches.clear()
        self.device_memory = _DeviceMemory()  # let the marked tensors go
        c = self.counts
        blocking = self.link.blocking_transfers - self._blocking0
        c.syncs += blocking
        c.sync_sites += [BLOCKING_LINK] * blocking
        launches = sum(_launch.LAUNCHES.values()) - self._launches0
        c.ops += launches
        c.op_names["triton launches"] = launches


def device_tensors(opt) -> list[torch.Tensor]:
    """What stands for device memory on a CPU-only run: every param, its gradient and its
    device-side state (``state.state_side``)."""
    from zenflow_triton.state import state_side

    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
            for key, t in opt.state.get(p, {}).items():
                if not isinstance(t, torch.Tensor):
                    continue
                try:
                    side = state_side(key, opt.config.accumulate_on)
                except KeyError:
                    continue
                if side == "device":
                    out.append(t)
    return out


def count_step(opt, closure=None) -> StepCounts:
    with counting(opt.link, device_tensors(opt)) as c:
        opt.step(closure)
    return c
