"""Multi-tensor launches: one kernel launch for many tensors, through a table.

A multi-tensor kernel gets, instead of one tensor's pointers, a table with one row of int64
fields per tensor (addresses, sizes, strides) and the cumulative count of tiles before each
tensor. Program ``pid`` finds its tensor by a binary search over that count
(:func:`tensor_of`), then loads the row and casts the addresses to typed pointers. So the
number of launches per step depends on the param groups and dtypes, not on the params, and
a launch costs at most one small host-to-device copy of its tables (non-blocking from
pinned memory on CUDA) instead of a custom-op dispatch per tensor. The address tables are
cached by content (:func:`tables`): a steady step, whose tensors and index sets are the
ones of the step before, uploads only its per-tensor scalars.

No Triton import at module level beyond the guarded one: the table building is plain
Python/numpy, usable without Triton.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # no Triton: the table helpers below still work
    from ._launch import NoTriton as triton
    triton.error = e


@triton.jit
def tensor_of(pid, cum_ptr, n_tensors, SEARCH: tl.constexpr):
    """The row i of the tensor that program ``pid`` works on: the largest i < n_tensors with
    cum[i] <= pid (cum[0] = 0, non-decreasing), in SEARCH >= bit_length(n_tensors) halvings;
    and pid's tile number within that tensor."""
    lo = pid * 0  # int64 zero
    hi = lo + n_tensors
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        go = tl.load(cum_ptr + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo, pid - tl.load(cum_ptr + lo)


def search_steps(n_tensors: int) -> int:
    """The constexpr SEARCH of :func:`tensor_of` for a table of ``n_tensors`` rows: enough
    halvings (``bit_length(n_tensors)``), rounded up to a multiple of 4 and at least 8.

    SEARCH is compiled in, and a launch's table length changes with the params that have
    work (columns to move, a param added): rounding keeps the compiled variants to one per
    size class (8 covers up to 255 tensors a launch) instead of one per count. Extra
    halvings are harmless: once ``hi = lo + 1`` the search stays put (``mid = lo``)."""
    return max(8, -(-int(n_tensors).bit_length() // 4) * 4)


def to_device_table(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host table on ``device``: on CUDA a non-blocking copy from pinned memory (the
    pinned block is not reused before the copy is done: torch's caching host allocator
    records the stream), elsewhere the table itself."""
    t = torch.from_numpy(np.ascontiguousarray(rows))
    if device.type == "cpu":
        return t
    if torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def cumulative(tiles: Sequence[int]) -> np.ndarray:
    """[0, t0, t0 + t1, ...] as int64: the tile count before each tensor, and the total."""
    out = np.zeros(len(tiles) + 1, dtype=np.int64)
    np.cumsum(np.asarray(tiles, dtype=np.int64), out=out[1:])
    return out


_CACHE_SIZE = 64
_cache: "collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]]" = \
    collections.OrderedDict()
_cache_lock = threading.Lock()
UPLOADS: "collections.Counter[str]" = collections.Counter()
"""Tables sent to a device, by kind ("rows": an address table and its tile counts, built
anew; "hyper": per-tensor scalars). Only grows: tests read differences."""


def tables(rows: Sequence[Sequence[int]], tiles: Sequence[int], device: torch.device,
           hyper: Sequence[float] | None = None) -> tuple[int, list[torch.Tensor]]:
    """The device tables of one multi-tensor launch, in the kernels' argument order: the
    rows (int64), the cumulative tile counts, and the per-tensor fp32 scalars when given;
    and the launch's grid size (the total tile count).

    The rows and counts are looked up by their content (device, addresses, sizes, strides,
    tiles: no ``id()`` of a wrapper, no read of device memory) among the last
    ``_CACHE_SIZE`` built, and sent to the device only when new: the set of tensors and
    index sets of a launch changes at a reselection or when params are added, not on a
    steady step. A cached table is never written, so reusing it is safe on any stream.
    The scalars change every step (bias corrections) and always travel."""
    cum = cumulative(tiles)
    meta = np.asarray(rows, dtype=np.int64)
    key = (str(device), meta.shape, meta.tobytes(), cum.tobytes())
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
    if hit is None:
        hit = (to_device_table(meta, device), to_device_table(cum, device))
        UPLOADS["rows"] += 1
        with _cache_lock:
            _cache[key] = hit
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    out = list(hit)
    if hyper is not None:
        out.append(to_device_table(np.asarray(hyper, dtype=np.float32), device))
        UPLOADS["hyper"] += 1
    return int(cum[-1]), out
