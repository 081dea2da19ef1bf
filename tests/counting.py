"""Counting on CPU what a GPU step would cost the host: blocking calls and launches.

``count_step(opt)`` runs ``opt.step()`` and returns a :class:`StepCounts`:

* ``syncs``: host-blocking calls made from the library's own code (``zenflow_triton/``), as
  a GPU would see them: every read of a tensor's value into Python (``.item()``,
  ``bool``/``float``/``int``/index of a tensor, all dispatched as ``_local_scalar_dense``),
  every op whose output size depends on the data (``nonzero``, ``masked_select``,
  ``unique``) or that returns a Python value (``equal``), every ``.tolist()`` and ``.cpu()``,
  plus the blocking transfers the library's ``Link`` counted. On a CPU run host-side
  bookkeeping counts too, so this is an upper bound of what a GPU would wait for.
* ``ops``: work-launching ops dispatched on the calling thread (aten and custom ops,
  views and metadata ops excluded: they launch nothing) plus the Triton kernels the
  library's launchers launched (``kernels._launch.LAUNCHES``).

The host worker's own threads are not counted: their copies and kernels run beside the
training stream, never in front of it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zenflow_triton
from zenflow_triton.kernels import _launch

_LIB = os.path.dirname(zenflow_triton.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)

_SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
             "aten::equal", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
             "aten::is_nonzero"}
_FREE_OPS = {"aten::detach", "aten::lift_fresh", "aten::alias", "aten::view", "aten::_unsafe_view",
             "profiler::_record_function_enter_new", "profiler::_record_function_exit"}


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


class _Mode(TorchDispatchMode):
    def __init__(self, counts: StepCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNC_OPS:
            site = _from_library()
            if site is not None:
                self.counts.syncs += 1
                self.counts.sync_sites.append(f"{name} at {site}")
        if not func.is_view and name not in _FREE_OPS:
            self.counts.ops += 1
            self.counts.op_names[name] = self.counts.op_names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class counting:
    """``with counting(link) as c:`` counts what runs inside into ``c`` (a StepCounts)."""

    def __init__(self, link) -> None:
        self.link = link
        self.counts = StepCounts()
        self._originals = {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu")}

    def _counted(self, method):
        real, counts = self._originals[method], self.counts

        def wrapper(tensor, *a, **k):
            site = _from_library()
            if site is not None:
                counts.syncs += 1
                counts.sync_sites.append(f".{method}() at {site}")
            return real(tensor, *a, **k)
        return wrapper

    def __enter__(self) -> StepCounts:
        self._blocking0 = self.link.blocking_transfers
        self._launches0 = sum(_launch.LAUNCHES.values())
        for m in self._originals:
            setattr(torch.Tensor, m, self._counted(m))
        self._mode = _Mode(self.counts)
        self._mode.__enter__()
        return self.counts

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for m, real in self._originals.items():
            setattr(torch.Tensor, m, real)
        c = self.counts
        blocking = self.link.blocking_transfers - self._blocking0
        c.syncs += blocking
        c.sync_sites += ["a blocking transfer (Link)"] * blocking
        launches = sum(_launch.LAUNCHES.values()) - self._launches0
        c.ops += launches
        c.op_names["triton launches"] = launches


def count_step(opt, closure=None) -> StepCounts:
    with counting(opt.link) as c:
        opt.step(closure)
    return c
