"""Whether a model's training state fits its accelerator with given settings, before any of
it is allocated: the device bytes of the params, their gradients and the optimizer's
device-side state (:func:`device_bytes`), against the device's memory
(:func:`device_capacity_bytes`). ``ZenFlowOptimizer.from_profile`` asks (:func:`check`), so
a profile tuned for a larger card fails at construction with the numbers and the leaner
settings that would fit, not later with an out-of-memory error.

What is counted is what the optimizer will hold on the device once every param has stepped
(``state``'s schema): a split matrix's ``k`` device-owned columns (fp32 moments, an fp32
master for a low-precision param, the column indices), its window accumulator where
``accumulate_on="device"``, and a whole param's AdamW state (the dense set, 1-D params,
small matrices). Activations, the framework's own buffers and the allocator's slack are
not: a setting that passes can still run out of memory, one that fails cannot fit.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterable

import torch

from .columns.layout import shape2d
from .columns.selection import num_selected
from .config import ZenFlowConfig
from .dist.fsdp import local
from .state import MATRIX, classify

INDEX_BYTES = 8
"""A column index (int64)."""

LEAN = dict(accumulate_on="host", dense_params=())
"""The settings that take the most optimizer state off the device: the window summed in
host memory, every large matrix split (no dense set). ``accumulator_dtype`` does not change
the device's share once the window is summed on the host."""

FIT_CHOICES = ("check", "lean", "skip")


class DoesNotFitError(ValueError):
    """The params, their gradients and the optimizer's device state need more memory than
    the device has, with the settings given."""


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _named(params: Iterable) -> list[tuple[str | None, torch.Tensor]]:
    out = []
    for item in params:
        if isinstance(item, dict):  # a param group: tensors or (name, tensor) pairs
            inner = _named(item["params"])
            names = item.get("param_names") or [n for n, _ in inner]
            out.extend(zip(names, (p for _, p in inner)))
        elif isinstance(item, tuple):
            out.append((item[0], item[1]))
        else:
            out.append((None, item))
    return out


def device_bytes(params: Iterable, config: ZenFlowConfig) -> DeviceBytes:
    """The device bytes of the trainable ``params`` (tensors, ``(name, tensor)`` pairs or
    param groups, as the optimizer takes them), their gradients (the params' dtype) and the
    optimizer's device-side state under ``config``."""
    par = grad = opt = 0
    for name, p in _named(params):
        if not p.requires_grad:
            continue
        # a DTensor (FSDP2) holds its share of the rows on each device
        share = local(p).numel() / max(1, p.numel())
        size = p.numel() * p.element_size()
        master = 4 if p.dtype != torch.float32 else 0
        if classify(p, config, name) == MATRIX:
            rows, cols = shape2d(p)
            k = num_selected(cols, config.topk_ratio)
            mine = rows * k * (8 + master) + cols * INDEX_BYTES
            if config.accumulate_on == "device" and config.update_interval > 1:
                itemsize = torch.empty(0, dtype=config.accumulator_torch_dtype).element_size()
                mine += rows * (cols - k) * itemsize
        else:
            mine = p.numel() * (8 + master)
        par, grad, opt = par + size * share, grad + size * share, opt + mine * share
    return DeviceBytes(int(par), int(grad), int(opt))


def device_capacity_bytes(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes, or None where it is not an accelerator torch can
    describe (the CPU: host memory is not this check's concern)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def _gb(n: int | float) -> str:
    return f"{n / 1e9:.1f} GB"


def check(params: list, config: ZenFlowConfig, fit: str = "check") -> dict:
    """The config fields to change so ``params`` fit their device: ``{}`` when they fit
    (or the device's memory is unknown, or ``fit="skip"``); :data:`LEAN` with ``fit="lean"``
    when only the lean settings fit (the caller warns); :class:`DoesNotFitError` otherwise,
    with the bytes needed, the device's, and what would fit."""
    if fit not in FIT_CHOICES:
        raise ValueError(f"fit must be one of {FIT_CHOICES}, got {fit!r}")
    tensors = [p for _, p in _named(params)]
    if fit == "skip" or not tensors:
        return {}
    device = tensors[0].device
    has = device_capacity_bytes(device)
    if has is None:
        return {}
    need = device_bytes(params, config)
    if need.total <= has:
        return {}
    lean_cfg = config.replace(**LEAN)
    lean = device_bytes(params, lean_cfg)
    text = (f"these settings need {_gb(need.total)} of device memory before activations (params "
            f"{_gb(need.params)}, gradients {_gb(need.grads)}, optimizer state "
            f"{_gb(need.optimizer)}); {device} has {_gb(has)}")
    if lean.total <= has:
        if fit == "lean":
            return dict(LEAN)
        raise DoesNotFitError(
            f"{text}. accumulate_on='host', dense_params=() would need {_gb(lean.total)}: "
            f"pass them as overrides, or fit='lean' to take them when needed "
            f"(their quality: docs/quality.md, 'The lean settings')")
    floor = need.params + need.grads
    if floor > has:
        raise DoesNotFitError(f"{text}: the params and gradients alone are {_gb(floor)}; "
                              "no optimizer setting makes this model fit one such device "
                              "(shard it with FSDP2 over more devices)")
    raise DoesNotFitError(f"{text}; even accumulate_on='host', dense_params=() need "
                          f"{_gb(lean.total)}: lower topk_ratio (the device keeps the state "
                          "of that share of each matrix's columns)")


def fitted(params: Iterable, config: ZenFlowConfig, fit: str = "check"
           ) -> tuple[list, ZenFlowConfig]:
    """The optimizer's params (as a list) and config, checked against the params' device
    (:func:`check`): with ``fit="lean"`` the lean changes taken, with a warning, where only
    they fit."""
    if fit not in FIT_CHOICES:
        raise ValueError(f"fit must be one of {FIT_CHOICES}, got {fit!r}")
    if isinstance(params, torch.Tensor):  # not an iterable of params: torch's error says so
        return params, config
    params = list(params)
    changes = check(params, config, fit)
    if changes:
        warnings.warn("these settings do not fit the device; taking "
                      + ", ".join(f"{k}={v!r}" for k, v in changes.items())
                      + " (fit='lean')", stacklevel=3)
        config = config.replace(**changes)
    return params, config


def profile_settings(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``ZenFlowOptimizer.from_profile``'s settings: profile ``name``'s, ``overrides`` over
    them."""
    from .profiles import load_profile  # lazy: profiles are not needed otherwise

    return {**load_profile(name).settings, **overrides}
