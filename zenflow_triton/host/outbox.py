"""Outboxes: where a host job leaves each param's result, in the param's dtype, for the apply.

One host arena per (device, dtype), pinned where CUDA exists, carved into per-param views:
the caching pinned allocator rounds every allocation up to a power of two, so one arena
wastes less than a buffer per param, and the apply crosses the link in one copy per arena
instead of one per param.

Ordering invariant: a job writes the views :meth:`Outboxes.plan` gave it; the apply reads
them with a copy on the link's host-to-device stream that the training stream waits for
(``Link.to_device_async``), and the next job
rewrites them only after the work queued before its own launch is done
(``CopyQueue.wait_launched``). A plan is made at each launch and used by that job's apply,
which always comes before the next launch.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ..transfer import Link, host_empty


class Outboxes:
    def __init__(self) -> None:
        self._arenas: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._used: dict[tuple[torch.device, torch.dtype], int] = {}
        self._layout: dict[Hashable, tuple[tuple, int, torch.Size]] = {}

    def plan(self, items: Sequence[tuple[Hashable, torch.Size, torch.dtype, torch.device]]
             ) -> dict[Hashable, torch.Tensor]:
        """A host view of ``shape`` and ``dtype`` for each ``(key, shape, dtype, device)``,
        packed per (device, dtype) into an arena that is kept while it is large enough."""
        offsets: dict[tuple, int] = {}
        layout = {}
        for key, shape, dtype, device in items:
            arena_key = (torch.device(device), dtype)
            off = offsets.get(arena_key, 0)
            layout[key] = (arena_key, off, torch.Size(shape))
            offsets[arena_key] = off + torch.Size(shape).numel()
        for arena_key, need in offsets.items():
            have = self._arenas.get(arena_key)
            if have is None or have.numel() < need:
                self._arenas[arena_key] = host_empty((need,), arena_key[1])
        self._used = offsets
        self._layout = layout
        return {key: self._view(self._arenas[a], off, shape)
                for key, (a, off, shape) in layout.items()}

    @staticmethod
    def _view(flat: torch.Tensor, off: int, shape: torch.Size) -> torch.Tensor:
        return flat[off:off + shape.numel()].view(shape)

    def to_device(self, link: Link, keys: Sequence[Hashable]) -> dict[Hashable, torch.Tensor]:
        """The planned views of ``keys`` on their devices: one copy per arena (its planned
        part) on the host-to-device stream, which the training stream waits for; counted."""
        wanted = {self._layout[k][0] for k in keys}
        on_device = {a: link.to_device_async(self._arenas[a][:self._used[a]], a[0])
                     for a in wanted}
        return {k: self._view(on_device[self._layout[k][0]], self._layout[k][1],
                              self._layout[k][2]) for k in keys}

    def arenas(self) -> list[torch.Tensor]:
        return list(self._arenas.values())

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._arenas.values())

    def clear_plan(self) -> None:
        """Forget the current plan (the state it was for was replaced); arenas are kept."""
        self._used, self._layout = {}, {}
