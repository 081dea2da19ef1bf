"""Host AdamW over flat fp32 buffers, in chunks of ``chunk_size`` elements.

Chunks are independent (AdamW is elementwise), so the result does not depend on the chunk
size or on how many threads run them; torch ops release the GIL, so a pool of threads runs
chunks in parallel.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..adamw_math import adamw_


@dataclass(frozen=True)
class HostHyper:
    """Hyperparameters of one host update, captured at the launching step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


class HostAdamW:
    """Runs AdamW on (master, grad, m, v) flat fp32 buffers with a pool of ``threads``."""

    def __init__(self, threads: int, chunk_size: int, timeout: float) -> None:
        self.threads = threads
        self.chunk_size = chunk_size
        self.timeout = timeout
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="zenflow-host-adamw")
                      if threads > 1 else None)

    def update(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor,
               v: torch.Tensor, hyper: HostHyper) -> None:
        flats = [t.view(-1) for t in (master, grad, m, v)]
        n = flats[0].numel()
        bounds = [(s, min(s + self.chunk_size, n)) for s in range(0, n, self.chunk_size)]
        if self._pool is None or len(bounds) == 1:
            for s, e in bounds:
                self._chunk(flats, s, e, hyper)
            return
        futures = [self._pool.submit(self._chunk, flats, s, e, hyper) for s, e in bounds]
        for f in futures:  # bounded: a stuck chunk raises TimeoutError, never hangs
            f.result(timeout=self.timeout)

    @staticmethod
    def _chunk(flats, s: int, e: int, h: HostHyper) -> None:
        master, grad, m, v = (t[s:e] for t in flats)
        adamw_(master, grad, m, v, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
               weight_decay=h.weight_decay, step=h.step)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
