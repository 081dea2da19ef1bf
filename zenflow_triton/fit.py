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
small matrices); the gradients, whole, or with ``stream_grads`` what the hooks hold at most
(``stream``). A fit leaves :data:`DEVICE_HEADROOM` of the device for the activations, the
framework's buffers and the allocator's slack (the constructor cannot know the batch:
``zenflow-tune predict`` counts the activations of a stated number of tokens). The host
side (:func:`host_bytes`: master, moments, accumulator, outbox of the host-owned columns)
is checked against the memory this machine has available, for every rank on it: under FSDP2
each rank holds its rows, and all the ranks of a machine take them from its memory
(:func:`ranks_on_host`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Iterable

import torch

from .columns.layout import shape2d
from .columns.selection import num_selected
from .config import ZenFlowConfig
from .dist.fsdp import is_dtensor, local
from .state import MATRIX, classify

INDEX_BYTES = 8
"""A column index (int64)."""

LEAN = dict(accumulate_on="host", dense_params=())
"""The settings that take the most optimizer state off the device: the window summed in
host memory, every large matrix split (no dense set). ``accumulator_dtype`` does not change
the device's share once the window is summed on the host."""
STREAMED = dict(LEAN, stream_grads=True)
""":data:`LEAN`, and the gradient streamed off the device during backward (``stream_grads``:
training unchanged, but a matrix's ``.grad`` is gone after backward: clip with
``max_grad_norm``): what a model whose gradient does not fit beside its params needs."""
STREAMING_CHANGES = (
    ". With stream_grads each matrix's gradient leaves the device during backward: its .grad "
    "is None after backward, so torch.nn.utils.clip_grad_norm_ (or a framework's clipping) "
    "would clip the biases and norms alone and GradScaler is refused; pass max_grad_norm=... "
    "to the optimizer instead, which clips every column by the global norm (docs/design.md, "
    "'Gradient streaming')")
"""What a warning that turns streaming on says it changes for ``.grad`` and clipping."""
DEVICE_HEADROOM = 0.1
"""The share of the device a fit leaves free (activations, the framework, the allocator)."""
HOST_HEADROOM = 0.1
"""The share of the host's available memory a fit leaves free."""

FIT_CHOICES = ("check", "lean", "skip")


class DoesNotFitError(ValueError):
    """The params, their gradients and the optimizer's device state need more memory than
    the device has, with the settings given."""


class StreamingRequired(DoesNotFitError):
    """Only with the gradient streamed off the device (``stream_grads=True``) would it fit."""


STREAMED_PARTS = ("streamed gradient (2 x the largest matrix)", "device columns' gradient",
                  "column scores (at a selection)")


def streamed_gradient_bytes(matrices: Iterable[tuple[float, int, int, int]]) -> dict[str, float]:
    """The most device bytes the split matrices' gradients take when they stream
    (``stream_grads``), by part (:data:`STREAMED_PARTS`), for ``(rows, cols, k, bytes per
    element)`` of each matrix (``rows``: this rank's): a backward hook holds one matrix's
    gradient and the gather of its host columns (twice the largest), every matrix keeps its
    ``k`` device columns' gradient, and a selection its column scores (fp32, whole on every
    rank). One formula for the fit check (:func:`device_bytes`) and the step model."""
    largest = device = scores = 0.0
    for rows, cols, k, itemsize in matrices:
        largest = max(largest, rows * cols * itemsize)
        device += rows * k * itemsize
        scores += cols * 4 if 0 < k < cols else 0
    return dict(zip(STREAMED_PARTS, (2 * largest, device, scores)))


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
    streamed = []
    for name, p in _named(params):
        if not p.requires_grad:
            continue
        # a DTensor (FSDP2) holds its share of the rows on each device
        share = local(p).numel() / max(1, p.numel())
        size = p.numel() * p.element_size()
        master = 4 if p.dtype != torch.float32 else 0
        kept = size  # its gradient on the device
        if classify(p, config, name) == MATRIX:
            rows, cols = shape2d(p)
            k = num_selected(cols, config.topk_ratio)
            mine = rows * k * (8 + master) + cols * INDEX_BYTES
            if config.accumulate_on == "device" and config.update_interval > 1:
                itemsize = torch.empty(0, dtype=config.accumulator_torch_dtype).element_size()
                mine += rows * (cols - k) * itemsize
            if config.stream_grads:  # counted below, with the hook's gradient
                kept = 0
                streamed.append((rows * share, cols, k, p.element_size()))
        else:
            mine = p.numel() * (8 + master)
        par, grad, opt = par + size * share, grad + kept * share, opt + mine * share
    grad += sum(streamed_gradient_bytes(streamed).values())
    return DeviceBytes(int(par), int(grad), int(opt))


def host_bytes(params: Iterable, config: ZenFlowConfig) -> int:
    """The host bytes the optimizer will hold for the trainable ``params``: per host-owned
    element of a split matrix its fp32 master and two moments (``host_state_dtype``), the
    window accumulator (``accumulate_on="host"``, a window of more than one step) and the
    outbox of a low-precision param (the result's copy in its dtype). An FSDP2 param
    counts the largest rank's rows of it (``ceil(rows / world)``): every rank counts
    alike, so every rank decides alike."""
    moment = torch.empty(0, dtype=config.host_moment_dtype).element_size()
    acc = torch.empty(0, dtype=config.accumulator_torch_dtype).element_size()
    total = 0.0
    for name, p in _named(params):
        if not p.requires_grad or classify(p, config, name) != MATRIX:
            continue
        rows, cols = shape2d(p)
        host = rows * (cols - num_selected(cols, config.topk_ratio))
        per = 4 + 2 * moment + (p.element_size() if p.dtype != torch.float32 else 0)
        if config.accumulate_on == "host" and config.update_interval > 1:
            per += acc
        total += host * per * _largest_share(p)
    return int(total)


def _largest_share(p: torch.Tensor) -> float:
    """The share of ``p``'s rows the rank with the most of them holds: ``ceil(rows /
    world)`` of an FSDP2 param (``torch.chunk``'s split), all of a plain one."""
    if not is_dtensor(p) or not p.shape or not p.shape[0]:
        return 1.0
    rows = p.shape[0]
    return min(rows, -(-rows // p.device_mesh.size())) / rows


def ranks_on_host(params: Iterable) -> tuple[int, str]:
    """How many ranks share this machine's memory for ``params``, and whence that number:
    for FSDP2 params ``LOCAL_WORLD_SIZE`` (torchrun sets it), else every rank of their mesh
    (as when they were all started on this machine); 1 for plain params (a DDP rank's
    host rows are not known here: each counts the whole host half, which is the node's
    total where its ranks share one machine)."""
    mesh = next((p.device_mesh for _, p in _named(params) if is_dtensor(p)), None)
    if mesh is None:
        return 1, "one process"
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        n = mesh.size()
        return n, (f"the {n} ranks of the FSDP2 mesh, all taken to run on this machine "
                   "(set LOCAL_WORLD_SIZE where they span machines)")
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={env!r}: the number of ranks on this machine must "
                         "be a positive integer (torchrun sets it)")
    return n, f"{n} ranks on this machine (LOCAL_WORLD_SIZE)"


def host_capacity_bytes() -> int | None:
    """The memory this machine has available now (``MemAvailable`` of /proc/meminfo), or
    None where that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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
    capacity = device_capacity_bytes(device)
    if capacity is None:
        return {}
    has = capacity * (1 - DEVICE_HEADROOM)
    need = device_bytes(params, config)
    if need.total <= has:
        check_host(params, config)
        return {}
    text = (f"these settings need {_gb(need.total)} of device memory before activations (params "
            f"{_gb(need.params)}, gradients {_gb(need.grads)}, optimizer state "
            f"{_gb(need.optimizer)}); {device} has {_gb(capacity)}, {_gb(has)} of it for these "
            f"({DEVICE_HEADROOM:.0%} left for activations and the allocator)")
    for changes, how in ((LEAN, "their quality: docs/quality.md, 'The lean settings'"),
                         (STREAMED, "training is unchanged by streaming, but a matrix's .grad "
                                    "is gone after backward: clip with max_grad_norm; "
                                    "docs/design.md, 'Gradient streaming'")):
        if all(getattr(config, k) == v for k, v in changes.items()):
            continue
        lean = device_bytes(params, config.replace(**changes))
        if lean.total <= has:
            named = ", ".join(f"{k}={v!r}" for k, v in changes.items())
            if fit == "lean":
                check_host(params, config.replace(**changes))
                return dict(changes)
            error = StreamingRequired if changes is STREAMED else DoesNotFitError
            raise error(f"{text}. {named} would need {_gb(lean.total)}: pass them as "
                        f"overrides, or fit='lean' to take them when needed ({how})")
    streamed = device_bytes(params, config.replace(**STREAMED))
    floor = streamed.params + streamed.grads
    if floor > has:
        raise DoesNotFitError(f"{text}: the params and the gradients in flight alone are "
                              f"{_gb(floor)} even with the gradient streamed off the device; "
                              "no optimizer setting makes this model fit one such device "
                              "(shard it with FSDP2 over more devices)")
    raise DoesNotFitError(f"{text}; even accumulate_on='host', dense_params=(), "
                          f"stream_grads=True need {_gb(streamed.total)}: lower topk_ratio "
                          "(the device keeps the state of that share of each matrix's "
                          "columns)")


def check_host(params: list, config: ZenFlowConfig) -> None:
    """DoesNotFitError where the optimizer's host state (:func:`host_bytes`) of every rank on
    this machine (:func:`ranks_on_host`) exceeds what it has available, less
    :data:`HOST_HEADROOM`."""
    has = host_capacity_bytes()
    if has is None:
        return
    ranks, whence = ranks_on_host(params)
    need = host_bytes(params, config) * ranks
    if need > has * (1 - HOST_HEADROOM):
        who = "" if ranks == 1 else f" ({whence}, {_gb(need / ranks)} each)"
        raise DoesNotFitError(
            f"these settings need {_gb(need)} of host memory for the host-owned "
            f"columns{who} (fp32 master, moments, accumulator, outbox); this machine has "
            f"{_gb(has)} "
            f"available ({HOST_HEADROOM:.0%} kept free): host_state_dtype='bfloat16' and "
            "accumulator_dtype='bfloat16' halve the moments and the sum, a higher "
            "topk_ratio keeps more columns on the device; fit='skip' to go on anyway")


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
        streams = changes.get("stream_grads") and not config.stream_grads
        warnings.warn("these settings do not fit the device; taking "
                      + ", ".join(f"{k}={v!r}" for k, v in changes.items())
                      + " (fit='lean')" + (STREAMING_CHANGES if streams else ""), stacklevel=3)
        config = config.replace(**changes)
    return params, config


def profile_settings(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """``ZenFlowOptimizer.from_profile``'s settings: profile ``name``'s, ``overrides`` over
    them."""
    from .profiles import load_profile  # lazy: profiles are not needed otherwise

    settings = {**load_profile(name).settings, **overrides}
    if settings.get("stream_grads") and "stream_grads" not in overrides:
        warnings.warn(f"profile {name!r} streams the gradients off the device during backward "
                      "(stream_grads=True: the model's gradient does not fit beside its params "
                      "there): a matrix's .grad is None after backward, so clip with "
                      "max_grad_norm=..., not clip_grad_norm_ (docs/design.md, 'Gradient "
                      "streaming'); stream_grads=False overrides it", UserWarning, stacklevel=3)
    return settings
