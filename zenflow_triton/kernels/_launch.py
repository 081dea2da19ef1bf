"""Launch heuristics for the Triton kernels, in one place (block sizes, num_warps, grids).

No Triton import here: the per-op launchers call these with plain ints.

Two regimes:

* **GPU**: tiles of ~2K elements (4 warps, 16 elements a thread) are enough to saturate
  memory bandwidth for these streaming kernels; bigger tiles only cost registers.
* **Interpreter** (``TRITON_INTERPRET=1``, tests on CPU): every program instance is a Python
  loop iteration over numpy blocks, so cost is per program, not per element; use tiles 8x
  larger so CPU tests stay fast.

Every block dimension is a power of two (``tl.arange`` needs it) and never larger than the
next power of two above the data, so a 1x1 tensor does not run a 2048-element tile.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os

import torch

# Elements per program instance.
_GPU_TILE = 2048
_INTERPRET_TILE = 16384
# Widest column block for the 2-D kernels: 64 fp32 = 256 B per row segment, i.e. two
# full 128 B lines when the selected columns are contiguous.
_GPU_MAX_BLOCK_C = 64
_INTERPRET_MAX_BLOCK_C = 128


LAUNCHES: "collections.Counter[str]" = collections.Counter()
"""Kernel launches made by this package's launchers, by kernel name (a Counter that only
grows: tests and benchmarks read differences). Lets a CPU run count what a GPU would launch."""


def launching(kernel, tensor: torch.Tensor):
    """``with launching(kernel, t):`` around a launch on ``t``'s device: counts it, and makes
    ``t``'s GPU the current one when it is not (Triton launches on the current device and
    its current stream, so a param on ``cuda:1`` needs ``cuda:1`` current). A no-op context
    on one GPU and on CPU. Every launch of this package's launchers goes through here,
    counted in :data:`LAUNCHES` by kernel name."""
    LAUNCHES[getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None),
                                                          "__name__", str(kernel))] += 1
    dev = tensor.device
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (read at call time, like Triton does)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_warps_for(tile: int) -> int:
    """Warps for a tile of ``tile`` elements: ~16 elements a thread, 1..8 warps."""
    return max(1, min(8, tile // 512))


def block_1d(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for an elementwise kernel over ``n`` elements."""
    tile = _INTERPRET_TILE if interpreting() else _GPU_TILE
    block = min(tile, next_pow2(n))
    return block, num_warps_for(block)


def tile_2d(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for a kernel tiling a [rows, cols] (or [rows, k]) grid.

    Columns are the fastest-moving dimension of the tile: the compact state [rows, k] is
    contiguous along k, and sorted column indices keep the gathered loads close together.
    """
    interp = interpreting()
    tile = _INTERPRET_TILE if interp else _GPU_TILE
    block_c = min(_INTERPRET_MAX_BLOCK_C if interp else _GPU_MAX_BLOCK_C, next_pow2(cols))
    block_r = min(next_pow2(rows), max(1, tile // block_c))
    return block_r, block_c, num_warps_for(block_r * block_c)


_NO_SKIP: dict[torch.device, torch.Tensor] = {}


def skip_flag(skip: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The int32 [1] skip flag (0 or 1) a masked kernel reads: ``skip`` itself, or a zero flag kept per
    device (made once, never written) when the caller has none."""
    if skip is not None:
        if skip.dtype != torch.int32 or skip.numel() != 1 or skip.device != device:
            raise ValueError(f"skip must be an int32 flag of one element on {device}, got "
                             f"{skip.dtype} {tuple(skip.shape)} on {skip.device}")
        return skip
    flag = _NO_SKIP.get(device)
    if flag is None:
        flag = _NO_SKIP[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """How many program instances keep the device busy (4 waves of one program per SM)."""
    if device.type == "cuda" and not interpreting():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 4 * _sm_count(index)
    # Interpreter / other devices: a few, so the split-rows path is exercised by the tests.
    return 8


def row_splits(rows: int, block_r: int, col_blocks: int, device: torch.device) -> int:
    """Into how many row ranges a column reduction is split (1 = no split).

    A reduction over rows with one program per column block has too little parallelism
    when there are few columns (e.g. [4096, 64] gives one program); splitting the rows
    writes per-split partial sums that a second, deterministic pass adds up. No atomics:
    the scores decide the selection, which must be reproducible bit for bit.
    """
    row_blocks = cdiv(rows, block_r)
    want = cdiv(target_programs(device), max(1, col_blocks))
    return max(1, min(row_blocks, want))


class NoTriton:
    """Stands in for the ``triton`` module where Triton is not installed.

    The per-op files import Triton guardedly so that their torch references (and
    ``TORCH_OPS``) work without it: with this stand-in, ``@triton.jit`` leaves the kernel a
    plain function that is never called, because every launcher calls
    :func:`require_triton` first. (Kernel annotations such as ``tl.constexpr`` are strings
    under ``from __future__ import annotations``, so a missing ``tl`` is never evaluated.)
    """

    error: ImportError | None = None

    @staticmethod
    def jit(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)


def require_triton(triton_module) -> None:
    """Raise ImportError (the "backend unavailable" signal) when Triton is missing."""
    if isinstance(triton_module, type) and issubclass(triton_module, NoTriton):
        raise ImportError(f"triton is not installed ({NoTriton.error})")


ALIGN_BYTES = 16
"""A 128-bit vector access: what Triton needs to know of an address to load 16 bytes at
once (a pointer argument's specialisation tells it; an address read from a table cannot)."""
ALIGN_ELEMENTS = 8
"""Every numel a multiple of this: a block's tail mask then never splits a vector of fp32
(4) or bf16/fp16 (8) elements."""


def vector_aligned(numel: int, *tensors) -> bool:
    """True when a multi-tensor kernel may promise Triton 16-byte aligned addresses and a
    numel that is a multiple of ``ALIGN_ELEMENTS`` (``tl.multiple_of``) for these tensors
    (``None`` entries skipped): a slice at an odd storage offset, or an odd size, gets the
    plain element-wise accesses instead. Reads addresses only (no device access)."""
    return numel % ALIGN_ELEMENTS == 0 and all(
        t.data_ptr() % ALIGN_BYTES == 0 for t in tensors if t is not None)
