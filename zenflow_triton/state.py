"""The per-param optimizer state: what it holds, on which side, how it is made.

A param's state is a plain dict in ``optimizer.state[p]`` (so it shows in ``state_dict``).
A SMALL param (1-D, a tiny matrix, the dense set) holds AdamW's own ``step``, ``exp_avg``,
``exp_avg_sq`` (and an fp32 ``master`` for a low-precision param), on its device. A MATRIX
param holds two compact halves of its ``[rows, cols]`` view (``columns.layout.view2d``):

* ``device_idx`` [k] sorted, ``device_m``/``device_v`` fp32 [rows, k] on the param's device,
  ``device_master`` fp32 [rows, k] when the param is bf16/fp16, ``device_step``;
* ``host_idx`` [n] sorted (the complement), ``host_master``/``host_m``/``host_v`` [rows, n]
  in host memory (master fp32, moments in ``host_state_dtype``), ``host_step``;
* ``acc`` (the window accumulator, or None), ``acc_count`` (gradients in it), ``acc_lr``
  (the sum of their steps' lrs),
  ``host_pending`` (a host result waits to be applied), ``selected``.

Each half has one Adam step count: the exponent of the group's betas in its moments' bias
corrections (for the host half, its windows under ``host_betas="step"``, the gradients
they held under ``"window"``: ``host.window.window_betas``).
"""

from __future__ import annotations

from typing import Any

import torch

from .columns.layout import shape2d, view2d
from .config import ZenFlowConfig
from .transfer import Link, state_zeros, to_host_memory

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
    keeps (data parallelism, see ``dist.shard``); all of them by default."""
    rows, cols = shape2d(p)
    r0, r1 = host_rows if host_rows is not None else (0, rows)
    return matrix_state(p, p.device,
                        link.to_host(view2d(p.detach())[r0:r1], dtype=torch.float32,
                                     pin=False).contiguous(),
                        state_zeros((r1 - r0, cols), moment_dtype),
                        state_zeros((r1 - r0, cols), moment_dtype), 0)


def matrix_state(p: torch.Tensor, device: torch.device, host_master: torch.Tensor,
                 host_m: torch.Tensor, host_v: torch.Tensor, host_step: int) -> dict:
    """A matrix param's state with every column host-owned (no device half yet, on
    ``device``), the given host half, and no window open. The one place the keys are
    listed."""
    rows, cols = shape2d(p)
    return {
        "kind": MATRIX,
        "selected": False,
        "device_idx": torch.empty(0, dtype=torch.long, device=device),
        "device_m": torch.zeros(rows, 0, device=device),
        "device_v": torch.zeros(rows, 0, device=device),
        **({"device_master": torch.zeros(rows, 0, device=device)}
           if p.dtype != torch.float32 else {}),
        "device_step": 0,
        "host_idx": torch.arange(cols, dtype=torch.long),
        "host_master": host_master,
        "host_m": host_m,
        "host_v": host_v,
        "host_step": host_step,
        "acc": None,  # made by the first step that accumulates (new_accumulator)
        "acc_count": 0,
        "acc_lr": 0.0,  # the sum of the lrs of the steps in the open window
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


ROW_SHARDED = ("host_master", "host_m", "host_v", "acc")
"""The state a rank keeps only its rows of under data parallelism (``dist.shard``): the host
halves and the window accumulator."""


def by_rows(key: str, ndim: int) -> bool:
    """Whether a per-param state tensor of ``ndim`` dimensions under ``key`` is laid out by
    the param's rows (every one but the column indices and 0-d counts): what FSDP2 splits."""
    return ndim >= 1 and not key.endswith("_idx")


def state_dtype(key: str, config: ZenFlowConfig) -> torch.dtype:
    """The dtype this optimizer holds a state tensor of ``key`` in."""
    return (torch.long if key.endswith("_idx")
            else config.host_moment_dtype if key in ("host_m", "host_v")
            else config.accumulator_torch_dtype if key == "acc"
            else torch.float32)


STATE_SIDES = {"device_idx": "device", "device_m": "device", "device_v": "device",
               "device_master": "device", "exp_avg": "device", "exp_avg_sq": "device",
               "master": "device", "host_idx": "host", "host_master": "host",
               "host_m": "host", "host_v": "host"}
"""Which side holds each state tensor (by key); ``acc`` is where ``accumulate_on`` says."""


def state_side(key: str, accumulate_on: str) -> str:
    if key == "acc":
        return accumulate_on
    return STATE_SIDES[key]


def misplaced(p: torch.Tensor, st: dict) -> bool:
    """Whether a framework moved this param's state (Lightning moves every state tensor to
    the param's device after loading a checkpoint, and to the CPU at teardown)."""
    if st["kind"] == MATRIX:
        return st["host_master"].device.type != "cpu" or st["device_m"].device != p.device
    return st["exp_avg"].device != p.device


def restore_param_state(p: torch.Tensor, saved: dict, config: ZenFlowConfig,
                        rows: tuple[int, int]) -> dict:
    """A checked saved state (:func:`check_param_state`) as this optimizer holds it: device
    tensors on the param's device, host tensors in pageable host memory, in the dtypes the
    config says, index tensors int64, step counts ints; of a host half or accumulator with
    all rows, this rank's ``rows``; no accumulator without an open window."""
    kind = saved["kind"]
    st: dict[str, Any] = {}
    r0, r1 = rows
    total = view2d(p).shape[0] if kind == MATRIX else 0
    for key, value in saved.items():
        if key == "acc" and int(saved.get("acc_count", 0)) == 0:
            continue  # no open window: no accumulator to hold (made when one opens)
        if key in ("step", "device_step", "host_step", "acc_count") \
                and isinstance(value, torch.Tensor):
            value = int(value.item())
        if key == "acc_lr":  # (a framework may hand it back as a tensor)
            value = float(value.item() if isinstance(value, torch.Tensor) else value)
        if not isinstance(value, torch.Tensor):
            st[key] = value
            continue
        if kind == MATRIX and key in ROW_SHARDED and value.shape[0] == total:
            value = value[r0:r1]  # this rank's rows of a full form
        dtype = state_dtype(key, config)
        if state_side(key, config.accumulate_on) == "host":
            st[key] = to_host_memory(value.detach(), dtype)  # straight to host memory
        else:
            st[key] = value.detach().to(device=p.device, dtype=dtype, copy=True)
    if kind == MATRIX:
        st["host_idx"] = st["host_idx"].cpu()
        if st.get("acc_count", 0) == 0:
            st["acc"] = None
            st.setdefault("acc_lr", 0.0)  # (saved before the window's lrs were summed)
    return st


def needs_setup(work, states) -> bool:
    """Whether a step over ``work`` ((group, param, grad) triples) makes or moves a param's
    state or selects a param's columns for the first time (host syncs anyway, and changes
    that a deferred NaN/inf check could not undo)."""
    for _, p, _ in work:
        st = states.get(p)
        if not st or misplaced(p, st) or (st["kind"] == MATRIX and not st["selected"]):
            return True
    return False


def prepared(p: torch.Tensor, st: dict, *, kind_of, config: ZenFlowConfig, link: Link,
             rows_of, busy: bool, name_of) -> dict | None:
    """The state ``p`` needs before a step, or None when ``st`` is fine as it is: made (every
    column host-owned; ``rows_of(rows)``: this rank's rows of a host half), or put back where it
    belongs after a framework moved it (the host half in host memory, the device half on the
    param's device; refused while host work is in flight, ``busy``). ``kind_of(p)``,
    ``name_of(p)``: the optimizer's, asked only when needed."""
    if not st:
        if kind_of(p) != MATRIX:
            return init_small_state(p)
        return init_matrix_state(p, link, config.host_moment_dtype, rows_of(p.shape[0]))
    if not misplaced(p, st):
        return None
    if busy:
        raise RuntimeError(
            f"the optimizer state of {name_of(p)} was moved off its devices while host work "
            "was in flight (a framework moved optimizer.state between steps); the moved "
            "copies may miss that work. Move state only after state_dict()/load_state_dict(), "
            "which wait for it")
    rows = rows_of(view2d(p).shape[0]) if st["kind"] == MATRIX else (0, 0)
    return restore_param_state(p, st, config, rows)


def unselected(work, states) -> list:
    """The entries of ``work`` whose matrix param has never been selected, with an empty
    accumulator and nothing pending (a param seen for the first time after a selection
    boundary: it selects at once)."""
    return [(g, p, gr) for g, p, gr in work for st in (states[p],)
            if st.get("kind") == MATRIX and not st["selected"] and st["acc_count"] == 0
            and not st["host_pending"]]
