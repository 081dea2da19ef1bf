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
side (:func:`host_bytes`, by :func:`host_terms`, the formula the step model uses too: every
host buffer the optimizer allocates, streamed gradients included) is checked against the
memory this machine has available, for every rank on it: under FSDP2 each rank holds its
rows, and all the ranks of a machine take them from its memory (:func:`ranks_on_host`);
where it does not fit, the error names the leaner host settings with their bytes
(:func:`leaner_host_settings`).
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


HOST_PARTS = ("master (fp32)", "moments (host_state_dtype)", "window accumulator",
              "outbox (param dtype)", "staging (param dtype)", "column indices",
              "worker scratch (pinned)", "moment scratch (bf16 moments)",
              "bounce buffers (pinned)", "streamed gradients", "later micro-batch's copy")
"""The names of :func:`host_terms`'s parts, in order."""


def _sizes(config) -> tuple[int, int]:
    """Bytes of a host moment element and of an accumulator element under ``config``."""
    return (torch.empty(0, dtype=config.host_moment_dtype).element_size(),
            torch.empty(0, dtype=config.accumulator_torch_dtype).element_size())


def _source(config) -> str:
    """Where a steady window's gradient comes from (``host.pipeline.Window.source``):
    ``"host_direct"`` (streamed, one-step windows), ``"host_acc"`` (summed on the host) or
    ``"device"`` (a one-step window's columns or a device accumulator, copied in by the
    job)."""
    if config.update_interval > 1:
        return "host_acc" if config.accumulate_on == "host" else "device"
    return "host_direct" if config.stream_grads else "device"


def _loads(config, itemsize: int, boxed: bool) -> bool:
    """Whether the host AdamW's workers load a matrix's gradient piece by piece into their
    scratch (``host.pipeline.HostPipeline._task``): a job applied at once (``overlap=False``,
    warm-up) copying from the device, or a gradient held in a narrower dtype than fp32."""
    source = _source(config)
    warm = config.warmup_steps > 0 and not config.stream_grads  # warm-up: applied at once
    if source == "host_direct":
        return itemsize < 4
    if source == "host_acc":
        return _sizes(config)[1] < 4 or warm
    return not config.overlap or warm or (boxed and itemsize < 4)


def host_terms(matrices: Iterable[tuple[float, int, int, int]], config, *, threads: int,
               cuda: bool, world: int = 1, micro_batches: int = 1) -> dict[str, float]:
    """The host bytes the optimizer holds at most, by part (:data:`HOST_PARTS`), for ``(rows,
    cols, k, bytes per element)`` of each split matrix (``rows``: this rank's) under
    ``config``, with ``threads`` host AdamW workers, params on a CUDA device or not, ``world``
    ranks and ``micro_batches`` backward passes per step. One formula for the fit check
    (:func:`host_bytes`) and the step model's host side; each part is what a room allocates:

    * master, moments, accumulator: ``state`` (the host-owned columns' fp32 master, two
      moments in ``host_state_dtype``, a window sum in ``accumulator_dtype`` where the host
      sums a window of more than one step);
    * outbox (``host.outbox``): the result in the param's dtype, for a CUDA or low-precision
      param unless a job applied at once writes the param itself (``overlap=False``, every
      column host-owned, one rank); else, overlapped, a staging buffer of the window's
      gradient in the param's dtype where the job copies it in (``host.pipeline``);
    * the host column indices (int64);
    * the workers' scratch (``host.adamw``): ``STREAM_PIECE`` fp32 elements each where
      pieces are loaded, and twice that for bf16 moments; the link's bounce buffers
      (``transfer.CopyQueue.copy_cast_on_host``), a piece in the param's dtype per worker
      (a piece: ``STREAM_PIECE`` elements, fewer with a smaller ``chunk_size``),
      where a job applied at once crosses a CUDA link;
    * with ``stream_grads`` (``grads.stream``), the gradients' host copies between backward
      and the host worker's use of them: at a selection every matrix's whole gradient, and
      a cut of its host columns made before its whole gradient goes; in a steady step a
      step's host columns (two steps' where a one-step window's overlapped job reads them
      until the next step's apply point), and a matrix's of the step before while the host
      worker adds them; with several micro-batches, a later micro-batch's copy until the
      adder thread has summed it: at most the largest matrix's (the hooks wait for the
      adder beyond that, ``GradStream.copy_bound``).
    """
    mats = list(matrices)
    out = dict.fromkeys(HOST_PARTS, 0.0)
    loads = _per_matrix(mats, config, cuda, world, out)
    if any(rows * (cols - k) for rows, cols, k, _ in mats):
        out.update(_per_worker(config, threads, cuda, loads,
                               max(b for *_, b in mats)))
        if config.stream_grads:
            out.update(_streamed(mats, config, micro_batches))
    return out


def _per_matrix(mats: list, config, cuda: bool, world: int, out: dict) -> bool:
    """:func:`host_terms`'s parts per host-owned element and column, added into ``out``;
    whether the workers load some matrix's gradient piece by piece."""
    s, a = _sizes(config)
    source = _source(config)
    loads = False
    for rows, cols, k, b in mats:
        host = rows * (cols - k)
        boxed = (cuda or b < 4) and (config.overlap or k > 0 or world > 1)
        out["master (fp32)"] += 4 * host
        out["moments (host_state_dtype)"] += 2 * s * host
        if source == "host_acc":
            out["window accumulator"] += a * host
        if boxed:
            out["outbox (param dtype)"] += b * host
        elif config.overlap and source == "device":
            out["staging (param dtype)"] += b * host
        out["column indices"] += INDEX_BYTES * (cols - k)
        loads = loads or (host > 0 and _loads(config, b, boxed))
    return loads


def _per_worker(config, threads: int, cuda: bool, loads: bool, itemsize: int) -> dict:
    """:func:`host_terms`'s buffers of each host AdamW worker: a piece (``STREAM_PIECE``
    elements, fewer with a smaller ``chunk_size``) of fp32 scratch where it loads pieces,
    two of fp32 moments for bf16 moments, one in the param dtype through the bounce buffer
    where a job applied at once crosses a CUDA link."""
    from .host.adamw import ALIGN, STREAM_PIECE  # lazy: fit is imported early

    piece = min(STREAM_PIECE, max(ALIGN, config.chunk_size // ALIGN * ALIGN))
    out = {}
    if loads:
        out["worker scratch (pinned)"] = threads * piece * 4
    if _sizes(config)[0] < 4:
        out["moment scratch (bf16 moments)"] = threads * 2 * piece * 4
    if cuda and (not config.overlap or config.warmup_steps > 0):
        out["bounce buffers (pinned)"] = threads * piece * itemsize
    return out


def _streamed(mats: list, config, micro_batches: int) -> dict:
    """:func:`host_terms`'s host copies of the streamed gradients (``stream_grads``)."""
    with_host = [(rows, cols, k, b) for rows, cols, k, b in mats if cols > k]
    whole = sum(rows * cols * b for rows, cols, k, b in with_host)
    cut = max(rows * (cols - k) * b for rows, cols, k, b in with_host)
    # a one-step window's job reads the host columns themselves until the next step's
    # apply point: with overlap, two steps' of them are held
    steps = 2 if _source(config) == "host_direct" and config.overlap else 1
    held = steps * sum(rows * (cols - k) * b for rows, cols, k, b in with_host)
    out = {"streamed gradients": max(whole + cut, held)}
    if micro_batches > 1:
        out["later micro-batch's copy"] = max(rows * cols * b for rows, cols, k, b in with_host)
    return out


def host_matrices(params: Iterable, config: ZenFlowConfig) -> list[tuple[float, int, int, int]]:
    """``(rows, cols, k, bytes per element)`` of each trainable split matrix of ``params``,
    ``rows`` the largest rank's share of an FSDP2 param (``ceil(rows / world)``: every rank
    counts alike, so every rank decides alike)."""
    out = []
    for name, p in _named(params):
        if p.requires_grad and classify(p, config, name) == MATRIX:
            rows, cols = shape2d(p)
            out.append((rows * _largest_share(p), cols, num_selected(cols, config.topk_ratio),
                        p.element_size()))
    return out


def host_bytes(params: Iterable, config: ZenFlowConfig, *, micro_batches: int = 2) -> int:
    """The host bytes the optimizer will hold at most for the trainable ``params``
    (:func:`host_terms`, with the workers ``config`` asks for or torch's threads, the params'
    device, and ``micro_batches`` backward passes a step: the constructor cannot know them,
    so it counts a later micro-batch's copy)."""
    named = _named(params)
    cuda = any(p.device.type == "cuda" for _, p in named)
    world = next((p.device_mesh.size() for _, p in named if is_dtensor(p)), 1)
    threads = config.host_threads or max(1, torch.get_num_threads())
    return int(sum(host_terms(host_matrices(named, config), config, threads=threads,
                              cuda=cuda, world=world, micro_batches=micro_batches).values()))


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


HOST_LEANER = (dict(host_state_dtype="bfloat16"), dict(accumulator_dtype="bfloat16"),
               dict(host_state_dtype="bfloat16", accumulator_dtype="bfloat16"),
               dict(accumulate_on="device"))
"""The settings that take host memory off the host state, leanest last: the moments in bf16,
the window sum in bf16, both, and the window summed on the device (where the device has room
for it; not with ``stream_grads``, which sums on the host)."""


def leaner_host_settings(config: ZenFlowConfig) -> list[tuple[dict, ZenFlowConfig]]:
    """Each of :data:`HOST_LEANER` that changes ``config`` (and that it allows), with the
    config it gives."""
    out = []
    for changes in HOST_LEANER:
        if all(getattr(config, k) == v for k, v in changes.items()):
            continue
        if "accumulate_on" in changes and config.stream_grads:
            continue
        out.append((changes, config.replace(**changes)))
    return out


def describe_leaner(options: list[tuple[dict, float]], has: float) -> str:
    """``options`` (changes, bytes they need) as a clause: each with its GB, whether it fits
    ``has`` bytes."""
    parts = []
    for changes, need in options:
        named = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        parts.append(f"{named}: {_gb(need)}" + (" (fits)" if need <= has else ""))
    return "; ".join(parts)


def check_host(params: list, config: ZenFlowConfig) -> None:
    """DoesNotFitError where the optimizer's host state (:func:`host_bytes`) of every rank on
    this machine (:func:`ranks_on_host`) exceeds what it has available, less
    :data:`HOST_HEADROOM`."""
    has = host_capacity_bytes()
    if has is None:
        return
    ranks, whence = ranks_on_host(params)
    need = host_bytes(params, config) * ranks
    room = has * (1 - HOST_HEADROOM)
    if need > room:
        who = "" if ranks == 1 else f" ({whence}, {_gb(need / ranks)} each)"
        leaner = describe_leaner([(changes, host_bytes(params, lean) * ranks)
                                  for changes, lean in leaner_host_settings(config)], room)
        raise DoesNotFitError(
            f"these settings need {_gb(need)} of host memory for the host-owned "
            f"columns{who} (fp32 master, moments, accumulator, outbox, staging, indices, "
            f"scratch, streamed gradients: fit.host_terms); this machine has {_gb(has)} "
            f"available ({HOST_HEADROOM:.0%} kept free). Leaner host settings: "
            f"{leaner or 'none left'} (their measured quality: docs/memory.md); a higher "
            "topk_ratio keeps more columns on the device; "
            "fit='skip' to go on anyway")


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
