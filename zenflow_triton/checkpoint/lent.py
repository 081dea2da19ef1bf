"""The tensors a state dict hands out, and the copy-on-write that keeps them as of the call.

``state_dict()`` returns references, as torch's does: no copy of the state is made to save
it. The per-param entries hold counts and flags copied at the call (``host_step``,
``acc_count``, ``host_pending``...), so their tensors must keep the values of the call too:
the optimizer writes its state in place (the device half's kernels, the host accumulation,
the host AdamW job running beside the next steps), and a state dict still held while the
optimizer goes on (kept in memory to load later, saved by a background thread, a cached
``prepare_state_dict``) would otherwise mix the counts of one step with moments of a later
one, read while a host job writes them. So the optimizer, before it next writes its state,
takes fresh copies of the tensors whose storage a state dict it handed out still holds; a
state dict already dropped (``torch.save(opt.state_dict(), f)``) costs nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (a DTensor's: its local tensor's)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


class Lent:
    """Weak references to the tensors of the state dicts handed out, by the storage each
    shares with the state."""

    def __init__(self) -> None:
        self._refs: list[tuple[weakref.ref, int]] = []

    def lend(self, sd: dict[str, Any], state: dict) -> None:
        """Record the tensors of ``sd``'s per-param entries; one that is the state's own
        tensor object is handed out as an alias of it (same storage, its own object), so
        that whether the caller still holds it can be told from the optimizer's reference."""
        own = {id(v) for st in state.values() if isinstance(st, dict)
               for v in st.values() if isinstance(v, torch.Tensor)}
        self._refs = [(ref, ptr) for ref, ptr in self._refs if ref() is not None]
        for entry in sd.get("state", {}).values():
            if not isinstance(entry, dict):
                continue
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor) or value.numel() == 0:
                    continue
                if id(value) in own:
                    value = entry[key] = value.detach()  # an alias: the same storage
                self._refs.append((weakref.ref(value), _storage_ptr(value)))

    def reclaim(self, state: dict) -> int:
        """Before the optimizer writes its state again (no host work in flight): each state
        tensor whose storage a handed-out tensor still alive shares is replaced by a copy,
        so what was handed out keeps the values of its call. Returns how many were copied."""
        held = {ptr for ref, ptr in self._refs if ref() is not None}
        self._refs = []
        copied = 0
        if not held:  # every state dict handed out was dropped (saved): nothing to copy
            return copied
        for st in state.values():
            if not isinstance(st, dict):
                continue
            for key, value in list(st.items()):
                if key.endswith("_idx"):  # replaced by a reselection, never written in place
                    continue
                if (isinstance(value, torch.Tensor) and value.numel()
                        and _storage_ptr(value) in held):
                    st[key] = value.clone()
                    copied += 1
        return copied

    def forget(self) -> None:
        """The state was replaced (load_state_dict): nothing of it was handed out."""
        self._refs = []


def lent_of(optimizer) -> Lent:
    """The optimizer's record (made on first use; a copy made by __setstate__ has none)."""
    lent = optimizer.__dict__.get("_lent")
    if lent is None:
        lent = optimizer.__dict__["_lent"] = Lent()
    return lent


__all__ = ["Lent", "lent_of"]
