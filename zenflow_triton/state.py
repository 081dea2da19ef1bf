"""The per-param optimizer state: what it holds, on which side, how it is made.

A param's state is a plain dict in ``optimizer.state[p]`` (so it shows in ``state_dict``).
A SMALL param (1-D, a tiny matrix, the dense set) holds AdamW's own ``step``, ``exp_avg``,
``exp_avg_sq`` (and an fp32 ``master`` for a low-precision param), on its device. A MATRIX
param holds two compact halves of its ``[rows, cols]`` view (``columns.layout.view2d``):

* ``device_idx`` [k] sorted, ``device_m``/``device_v`` fp32 [rows, k] on the param's device,
  ``device_master`` fp32 [rows, k] when the param is bf16/fp16, ``device_step``;
* ``host_idx`` [n] sorted (the complement), ``host_master``/``host_m``/``host_v`` [rows, n]
  in host memory (master fp32, moments in ``host_state_dtype``), ``host_step``;
* ``acc`` (the window accumulator, or None), ``acc_count`` (gradients in it),
  ``host_pending`` (a host result waits to be applied), ``selected``.

Each half has one Adam step count.
"""

from __future__ import annotations

import torch

from .columns.layout import shape2d, view2d
from .config import ZenFlowConfig
from .transfer import Link, state_zeros

MATRIX = "matrix"
SMALL = "small"


def classify(p: torch.Tensor, cfg: ZenFlowConfig, name: str | None = None) -> str:
    """MATRIX params are split by columns; SMALL ones are device-owned entirely: 1-D params,
    matrices under ``min_offload_numel`` elements, and the dense set (a param whose ``name``
    matches ``dense_params``)."""
    if p.dim() < 2 or p.numel() < cfg.min_offload_numel or cfg.is_dense(name):
        return SMALL
    return MATRIX


def init_matrix_state(p: torch.Tensor, link: Link,
                      moment_dtype: torch.dtype = torch.float32,
                      host_rows: tuple[int, int] | None = None) -> dict:
    """Every column host-owned, zero moments (host ones in ``moment_dtype``), fp32 master
    copied from the param. ``host_rows``: the rows ``[r0, r1)`` of the host half this rank
    keeps (data parallelism, see ``shard``); all of them by default."""
    rows, cols = shape2d(p)
    dev = p.device
    r0, r1 = host_rows if host_rows is not None else (0, rows)
    return {
        "kind": MATRIX,
        "selected": False,
        "device_idx": torch.empty(0, dtype=torch.long, device=dev),
        "device_m": torch.zeros(rows, 0, device=dev),
        "device_v": torch.zeros(rows, 0, device=dev),
        **({"device_master": torch.zeros(rows, 0, device=dev)}
           if p.dtype != torch.float32 else {}),
        "device_step": 0,
        "host_idx": torch.arange(cols, dtype=torch.long),
        "host_master": link.to_host(view2d(p.detach())[r0:r1], dtype=torch.float32,
                                    pin=False).contiguous(),
        "host_m": state_zeros((r1 - r0, cols), moment_dtype),
        "host_v": state_zeros((r1 - r0, cols), moment_dtype),
        "host_step": 0,
        "acc": None,  # made by the first step that accumulates (new_accumulator)
        "acc_count": 0,
        "host_pending": False,
    }


def init_small_state(p: torch.Tensor) -> dict:
    """A small param's state: AdamW's zero moments on its device (and an fp32 master copied
    from a low-precision param)."""
    st = {"kind": SMALL, "step": 0,
          "exp_avg": torch.zeros_like(p, dtype=torch.float32),
          "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
    if p.dtype != torch.float32:
        st["master"] = p.detach().float().clone()
    return st


def new_accumulator(rows: int, n: int, device: torch.device, accumulate_on: str,
                    dtype: torch.dtype = torch.float32):
    """The window accumulator of ``n`` host-owned columns (fp32, zero): on the param's device,
    or in pageable host memory (``accumulate_on="host"``: no copy reads it across the link).
    Made only when a window accumulates (not in warm-up or one-step windows, which hand
    their gradient over as it is), and dropped when a selection changes the split."""
    if accumulate_on == "device":
        return torch.zeros(rows, n, device=device, dtype=dtype)
    return state_zeros((rows, n), dtype)


STATE_SIDES = {"device_idx": "device", "device_m": "device", "device_v": "device",
               "device_master": "device", "exp_avg": "device", "exp_avg_sq": "device",
               "master": "device", "host_idx": "host", "host_master": "host",
               "host_m": "host", "host_v": "host"}
"""Which side holds each state tensor (by key); ``acc`` is where ``accumulate_on`` says."""


def state_side(key: str, accumulate_on: str) -> str:
    if key == "acc":
        return accumulate_on
    return STATE_SIDES[key]
