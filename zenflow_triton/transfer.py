"""Device <-> host copies, and the count of every byte that crosses the link.

Host memory is pinned where CUDA exists (``pin_memory=True`` raises on a CPU-only torch).
On a CPU-only run "device" and host are the same memory, but the copies are still made
(the host works on its own buffers while the training loop goes on) and counted as the bytes
that would cross the link.
"""

from __future__ import annotations

import threading

import torch


def host_can_pin() -> bool:
    return torch.cuda.is_available()


def host_empty(shape, dtype=torch.float32) -> torch.Tensor:
    """Uninitialised host tensor, pinned where CUDA exists."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=host_can_pin())


def host_zeros(shape, dtype=torch.float32) -> torch.Tensor:
    t = host_empty(shape, dtype)
    t.zero_()
    return t


def to_host_memory(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``t`` (pinned where possible), not counted: for loading state."""
    out = host_empty(t.shape, dtype or t.dtype)
    out.copy_(t)
    return out


class Link:
    """Counts bytes per direction; thread-safe (the host worker copies too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_d2h = 0
        self.bytes_h2d = 0

    def _count(self, d2h: int = 0, h2d: int = 0) -> None:
        with self._lock:
            self.bytes_d2h += d2h
            self.bytes_h2d += h2d

    def to_host(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a device tensor into new host memory (cast after the transfer: the link
        carries ``src``'s dtype)."""
        self._count(d2h=src.numel() * src.element_size())
        out = host_empty(src.shape, src.dtype)
        out.copy_(src, non_blocking=False)
        return out if dtype is None or dtype == src.dtype else out.to(dtype)

    @staticmethod
    def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor into the host buffer ``dst`` (cast on the host side), for a
        transfer counted with :meth:`count_d2h` where it was planned, so byte counts never
        depend on when a worker thread runs."""
        dst.copy_(src)
        return dst

    def to_device(self, src: torch.Tensor, device: torch.device,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
        """``src`` on ``device``; cast on the host first when ``dtype`` is given (the link
        carries the narrower type). The result may be ``src`` itself where host and device
        are one memory: callers only read it or own it."""
        if dtype is not None and dtype != src.dtype:
            src = src.to(dtype)
        self._count(h2d=src.numel() * src.element_size())
        if src.device == torch.device(device):
            return src  # CPU-only run: the "device" already holds it; counted all the same
        return src.to(device, non_blocking=False)

    def count_d2h(self, nbytes: int) -> None:
        self._count(d2h=nbytes)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where pinning is impossible, else a pinned copy (for host state)."""
    if not host_can_pin() or t.is_pinned():
        return t
    return to_host_memory(t)
