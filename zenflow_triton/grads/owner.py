"""Which open optimizer takes each param's gradient in a backward hook (``stream_grads``).

A streaming ``ZenFlowOptimizer`` takes a matrix's gradient out of ``.grad`` in a
post-accumulate-grad hook (``stream``), so any other optimizer over the same param would
find ``.grad`` None and train nothing of it, silently. So:

* a ``ZenFlowOptimizer`` built over params an open streaming one hooks, streaming or not,
  takes them over (:func:`take_over`): the old one's hooks on them are removed, with one
  warning naming both optimizers and the params; the old one then sees their ``.grad`` as
  any optimizer does;
* another optimizer (``torch.optim.AdamW``...) cannot be told apart at construction: the
  first ``step()`` it takes over params an open streaming optimizer hooks is warned about
  (:func:`_foreign_step`, a global step pre-hook of ``torch.optim``, installed with the first
  streaming hook), naming both; ``close()`` the streaming one first.

By ``id(param)``: a tensor's ``==`` is elementwise, no dict key; an id reused by a later
tensor is overwritten when that one's optimizer claims it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_OWNER: dict[int, weakref.ref] = {}
"""id(param) -> the stream (``stream.GradStream``) whose hook takes its gradient."""
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Foreign optimizers already warned about (once each)."""
_GLOBAL_HOOK: list = []


def owner(p: torch.Tensor) -> Any | None:
    """The open streaming stream whose hook takes ``p``'s gradient, or None."""
    ref = _OWNER.get(id(p))
    stream = ref() if ref is not None else None
    return stream if stream is not None and stream.active else None


def holds(stream: Any, p: torch.Tensor) -> bool:
    """Whether ``stream``'s hook is the one that takes ``p``'s gradient now."""
    ref = _OWNER.get(id(p))
    return ref is not None and ref() is stream


def claim(stream: Any, p: torch.Tensor) -> None:
    """``stream``'s hook takes ``p``'s gradient from now on (after :func:`take_over`)."""
    _OWNER[id(p)] = weakref.ref(stream)
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_foreign_step))


def release(stream: Any, p: torch.Tensor | None = None) -> None:
    """``stream`` holds ``p`` (default: every param it holds) no more: its hooks are
    removed."""
    if p is not None:
        if holds(stream, p):
            del _OWNER[id(p)]
        return
    for key in [k for k, ref in _OWNER.items() if ref() is stream or ref() is None]:
        del _OWNER[key]


def take_over(stream: Any, params, name_of: Callable[[torch.Tensor], str]) -> None:
    """Before ``stream``'s optimizer uses ``params``: every other open streaming optimizer
    gives up its hooks on them (one warning per such optimizer, naming both)."""
    taken: dict[int, tuple[Any, list[str]]] = {}
    for p in params:
        old = owner(p)
        if old is not None and old is not stream:
            old.give_up(p)
            taken.setdefault(id(old), (old, []))[1].append(name_of(p))
    for old, names in taken.values():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        warnings.warn(
            f"{stream.label} ({'streaming' if stream.active else 'not streaming'}) is built "
            f"over {len(names)} param(s) whose gradients {old.label}, still open and "
            f"streaming, takes in backward hooks ({', '.join(names[:3])}{more}): the new one "
            "takes them over and the old one's hooks on them are removed, so the old one no "
            "longer streams them; close() it", UserWarning, stacklevel=4)


def _foreign_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: an optimizer other than a ZenFlowOptimizer stepping
    params whose gradients an open streaming one takes is warned about, once."""
    if not _OWNER or hasattr(optimizer, "_stream") or optimizer in _WARNED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            old = owner(p)
            if old is not None:
                _WARNED.add(optimizer)
                warnings.warn(
                    f"{type(optimizer).__name__} steps params whose gradients {old.label}, "
                    "still open and streaming (stream_grads=True), takes out of .grad in "
                    "backward hooks: it finds their .grad None and trains nothing of them. "
                    "close() the ZenFlowOptimizer before building another optimizer over "
                    "its params", UserWarning, stacklevel=4)
                return
