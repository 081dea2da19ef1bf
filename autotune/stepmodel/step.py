"""One prediction: a mode's graph scheduled on the lanes, its steady-state step time, stall,
link bytes, host busy fraction and memory, and whether it fits in device memory; the same
for every mode at once; and the host AdamW job alone (:func:`host_update_seconds`), which
needs no accelerator facts, so it can be checked against a host update measured on any
machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .inputs import (DEFAULT_HOST_CORES_PER_ACCELERATOR, MODES, SETTING_KEYS, SHARDINGS, Hardware,
                     StepModelError, zenflow_config)
from .workload import Workload
from .modes import (adamw, gpu_costs, memory_use, overlapped_offload,
                    state_bytes, state_swap, zenflow, zenflow_split, zero_offload,
                    zero_offload_dpu)
from .activations import activation_bytes
from .timeline import Prediction, steady_window


def predict(hw: Hardware, wl: Workload, mode: str, *, gpus: int = 1, config: Any = None,
            window_steps: int | None = None, prefetch_result: bool = False,
            sharding: str = "ddp", resident_fraction: float | None = None,
            **settings: Any) -> Prediction:
    """Predict one mode's steady-state window (``window_steps`` steps, default the zenflow
    ``update_interval``). ``config`` (a ZenFlowConfig or dict) and ``settings`` (its fields,
    e.g. ``topk_ratio=0.1, update_interval=4, overlap=True, accumulate_on="device"``) are the
    ZenFlow settings; the other modes use only ``min_offload_numel`` and ``host_threads``
    from them (which params stay on the device, scratch): their host moments are fp32, as
    their software keeps them, whatever ``host_state_dtype`` says. ``sharding``: ``"ddp"``
    (each GPU holds the whole model) or ``"fsdp2"`` (``fully_shard``: each GPU holds 1/N of
    the params, gradients and device state, and updates only its rows).
    ``resident_fraction``: the share of the Adam state that ``"state-swap"`` keeps on the
    device (NeMo-RL's ``1 - optimizer_offload_fraction``); None: the most that fits
    (:func:`resident_that_fits`)."""
    _check(mode, gpus, sharding, resident_fraction)
    cfg = zenflow_config(config, **settings)
    if mode == "state-swap" and resident_fraction is None:
        resident_fraction = resident_that_fits(hw, wl, gpus=gpus, config=cfg,
                                               sharding=sharding)
    resident_fraction = resident_fraction or 0.0
    K = cfg.update_interval if mode == "zenflow" else (window_steps or cfg.update_interval)
    # ZenFlow keeps its dense set whole on the device; the other modes offload every matrix.
    c = gpu_costs(hw, wl, gpus, cfg.min_offload_numel,
                  cfg.dense_params if mode == "zenflow" else (), sharding)
    if mode == "overlapped-offload" and c.micro > 1:
        return _refused(hw, wl, mode, K, "steps inside backward cannot accumulate gradients "
                        f"over {c.micro} micro-batches (torchtune's optimizer-in-backward "
                        "refuses gradient accumulation)")
    g = _graph(mode, c, K, wl, cfg, prefetch_result, resident_fraction, sharding)
    window, segs, busy = steady_window(g.lanes, g.starts)
    step = window / K + g.extra
    stall = (window - busy["device"] + K * g.extra) / (K * step) if step > 0 else 0.0
    host_busy = busy["host"] / (K * step) if step > 0 else 0.0
    mem, dev_bytes, host_bytes, dev_fits, host_fits = _memory(hw, wl, mode, c, cfg, gpus,
                                                               resident_fraction)
    notes = g.notes + _memory_notes(hw, wl, gpus, dev_bytes, host_bytes, dev_fits, host_fits)
    if mode == "zenflow" and not host_fits:
        notes.append(_leaner_host_note(hw, wl, c, cfg, gpus))
    fits = dev_fits and host_fits
    return Prediction(
        mode=mode, step_time_s=step if fits else None,
        stall_fraction=max(0.0, stall) if fits else None,
        link_bytes_per_step=g.down + g.up, link_down_bytes_per_step=g.down,
        link_up_bytes_per_step=g.up, host_busy_fraction=host_busy if fits else None,
        device_memory_bytes=dev_bytes, host_memory_bytes=host_bytes, fits=fits,
        modelled_step_time_s=step, window_steps=K, window_time_s=window, timeline=segs,
        memory=mem, settings=g.settings, notes=notes, micro_batch_tokens=wl.micro_tokens,
        micro_batches=wl.micro_batches)


def _check(mode: str, gpus: Any, sharding: str, resident_fraction: float | None) -> None:
    if mode not in MODES:
        raise StepModelError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise StepModelError(f"gpus must be an int >= 1, got {gpus!r}")
    if sharding not in SHARDINGS:
        raise StepModelError(f"unknown sharding {sharding!r}; shardings: "
                             f"{', '.join(SHARDINGS)}")
    if resident_fraction is not None and not 0.0 <= resident_fraction <= 1.0:
        raise StepModelError(f"resident_fraction must be in [0, 1], got {resident_fraction!r}")


@dataclass
class _Graph:
    """A mode's scheduled windows, its link bytes per step each way, the amortised extra
    time per step, its notes and (ZenFlow) the settings it ran with."""

    lanes: Any
    starts: list[float]
    down: float
    up: float
    extra: float = 0.0
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] | None = None


def _graph(mode: str, c: Any, K: int, wl: Workload, cfg: Any, prefetch_result: bool,
           resident: float, sharding: str) -> _Graph:
    """Lay out ``mode``'s graph (:mod:`.modes`) and count what it sends over the link."""
    P, sharded_ddp = sum(c.matrix) / c.n_gpus, c.n_gpus > 1 and sharding == "ddp"
    if mode == "adamw":
        g = _Graph(*adamw(c, K), 0.0, 0.0)
        if sharded_ddp:
            g.notes.append("optimizer state sharded over the GPUs (ZeRO-1/2); its all-gather "
                           "is not modelled")
        return g
    if mode in ("zero-offload", "zero-offload-dpu"):
        graph = zero_offload if mode == "zero-offload" else zero_offload_dpu
        # the gradient sum's round trips between micro-batches, then the gradient down
        each_way = P * c.b + (c.micro - 1) * P * c.b
        g = _Graph(*graph(c, K), each_way, each_way)
        if c.micro > 1:
            g.notes.append(f"{c.micro} micro-batches of {wl.micro_tokens} tokens: the gradient "
                           "sum goes up and back down over the link during each backward "
                           "(DeepSpeed keeps it in pinned host memory)")
        return g
    if mode == "overlapped-offload":
        return _Graph(*overlapped_offload(c, K), P * c.b, P * c.b)
    if mode == "state-swap":
        moved = P * (1.0 - resident) * state_bytes(c)
        g = _Graph(*state_swap(c, K, resident), moved, moved)
        g.notes.append(f"{resident:.0%} of the Adam state resident on the device, the rest "
                       "streamed through it every step")
        if sharded_ddp:
            g.notes.append("Adam state sharded over the GPUs (ZeRO-1/2); its all-gather is "
                           "not modelled")
        return g
    (lanes, starts), extra, info = zenflow(c, K, wl, cfg, prefetch_result)
    out_settings = {k: getattr(cfg, k) for k in SETTING_KEYS}
    out_settings["select_interval"] = cfg.effective_select_interval
    out_settings["prefetch_result"] = prefetch_result
    g = _Graph(lanes, starts, info["link_down_per_window"] / K, info["link_up_per_window"] / K,
               extra, settings=out_settings)
    if extra:
        g.notes.append(f"a reselection every {cfg.effective_select_interval} steps drains the "
                       f"host job: +{extra * 1e3:.3g} ms per step, amortised")
    return g


def _memory_notes(hw: Hardware, wl: Workload, gpus: int, dev_bytes: int, host_bytes: int,
                  dev_fits: bool, host_fits: bool) -> list[str]:
    notes = []
    if not dev_fits:
        notes.append(f"does not fit: needs {dev_bytes / 1e9:.1f} GB of device memory "
                     f"(activations of {wl.micro_tokens} tokens included), the device has "
                     f"{hw.device_memory_bytes / 1e9:.0f} GB, {hw.usable_device_bytes / 1e9:.1f} "
                     "usable")
    if not host_fits:
        procs = hw.processes_per_host(gpus)
        node_host = host_bytes * procs  # the node's GPU processes share its memory
        notes.append(f"does not fit the host: {procs} process(es) need {node_host / 1e9:.1f} GB "
                     f"of host memory, the host has {hw.host_memory_bytes / 1e9:.0f} GB, "
                     f"{hw.usable_host_bytes / 1e9:.1f} usable")
    return notes


def _leaner_host_note(hw: Hardware, wl: Workload, c: Any, cfg: Any, gpus: int) -> str:
    """The leaner host settings (``fit.leaner_host_settings``: bf16 moments, a bf16 window
    sum, the sum on the device) with the host memory each needs, and whether it fits; the
    device's share is not rechecked here (the window summed on the device costs device
    memory)."""
    from zenflow_triton.fit import describe_leaner, leaner_host_settings

    procs = hw.processes_per_host(gpus)
    options = [(changes, _memory(hw, wl, "zenflow", c, lean, gpus, 0.0)[2] * procs)
               for changes, lean in leaner_host_settings(cfg)]
    text = describe_leaner(options, hw.usable_host_bytes)
    return (f"leaner host settings: {text} (their measured quality: docs/memory.md)"
            if text else "no leaner host setting is left")


def _memory(hw: Hardware, wl: Workload, mode: str, c: Any, cfg: Any, gpus: int,
            resident_fraction: float) -> tuple[dict, int, int, bool, bool]:
    """A mode's memory on each side (:func:`~.modes.memory_use`), their totals, and whether
    each fits (the host: the node's GPU processes together)."""
    procs = hw.processes_per_host(gpus)
    threads = cfg.host_threads or (max(1, hw.host_cores // procs) if hw.host_cores
                                   else DEFAULT_HOST_CORES_PER_ACCELERATOR)
    mem = memory_use(mode, wl, c, cfg, threads, resident_fraction)
    dev_bytes = int(round(sum(mem["device"].values())))
    host_bytes = int(round(sum(mem["host"].values())))
    dev_fits = hw.device_memory_bytes is None or dev_bytes <= hw.usable_device_bytes
    host_fits = hw.host_memory_bytes is None or host_bytes * procs <= hw.usable_host_bytes
    return mem, dev_bytes, host_bytes, dev_fits, host_fits


def memory_fits(hw: Hardware, wl: Workload, mode: str, *, gpus: int = 1, config: Any = None,
                sharding: str = "ddp", resident_fraction: float | None = None,
                device_only: bool = False, **settings: Any) -> bool:
    """Whether :func:`predict` would say the mode fits (device and host memory, and a mode
    that runs this workload at all; ``device_only``: the device's memory alone), without
    laying out its timeline."""
    cfg = zenflow_config(config, **settings)
    if mode == "overlapped-offload" and wl.micro_batches > 1:
        return False
    if mode == "state-swap" and resident_fraction is None:
        resident_fraction = resident_that_fits(hw, wl, gpus=gpus, config=cfg,
                                               sharding=sharding)
    c = gpu_costs(hw, wl, gpus, cfg.min_offload_numel,
                  cfg.dense_params if mode == "zenflow" else (), sharding)
    _, _, _, dev_fits, host_fits = _memory(hw, wl, mode, c, cfg, gpus, resident_fraction or 0.0)
    return dev_fits and (host_fits or device_only)


def _refused(hw: Hardware, wl: Workload, mode: str, K: int, why: str) -> Prediction:
    """A mode that cannot run this workload at all (not a memory question): no time, no
    memory, the reason as its note."""
    return Prediction(mode=mode, step_time_s=None, stall_fraction=None, link_bytes_per_step=0.0,
                      link_down_bytes_per_step=0.0, link_up_bytes_per_step=0.0,
                      host_busy_fraction=None, device_memory_bytes=0, host_memory_bytes=0,
                      fits=False, modelled_step_time_s=None, window_steps=K, window_time_s=0.0,
                      timeline=[], memory={"device": {}, "host": {}}, settings=None,
                      notes=[f"does not run: {why}"], micro_batch_tokens=wl.micro_tokens,
                      micro_batches=wl.micro_batches)


def predict_all(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                modes: Sequence[str] = MODES, sharding: str = "ddp",
                resident_fraction: float | None = None,
                **settings: Any) -> dict[str, Prediction]:
    """:func:`predict` for every mode, windows of the zenflow ``update_interval`` steps."""
    cfg = zenflow_config(config, **settings)
    return {m: predict(hw, wl, m, gpus=gpus, config=cfg, sharding=sharding,
                       resident_fraction=resident_fraction) for m in modes}


def resident_that_fits(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                       sharding: str = "ddp") -> float:
    """The largest share of the Adam state (a multiple of 1%) that state-swap can keep on the
    device beside everything else it holds there: 1.0 without a memory limit, 0.0 when even
    streaming all of it does not fit."""
    if hw.device_memory_bytes is None:
        return 1.0
    cfg = zenflow_config(config)
    c = gpu_costs(hw, wl, gpus, cfg.min_offload_numel, (), sharding)
    _, dev_bytes, state, _, _ = _memory(hw, wl, "state-swap", c, cfg, gpus, 0.0)
    # state: all of this GPU's Adam state, streamed
    room = hw.usable_device_bytes - dev_bytes
    if state <= 0:
        return 1.0
    return max(0, min(100, int(100 * room / state))) / 100


def host_update_seconds(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                        **settings: Any) -> float:
    """The model's time of one host AdamW job at a window boundary (ZenFlow, host-owned
    elements of this GPU's rows / host rate). Needs no accelerator facts (the cpu profile
    works), so it can be checked against a measured host update on any machine."""
    cfg = zenflow_config(config, **settings)
    e_host = zenflow_split(wl, cfg)[1]
    return e_host / gpus / hw.host_rate(gpus)


LEAN_CHOICES = dict(accumulate_on=("device", "host"), accumulator_dtype=("float32", "bfloat16"),
                    dense_params=(None, ()), topk_ratio=(None, 0.05, 0.02, 0.01),
                    stream_grads=(None, True), host_state_dtype=(None, "bfloat16"))
"""What :func:`fitting_zenflow` may change to make ZenFlow fit, from the settings given
(``None``: keep the given value): where and in which dtype the window is summed, the dense
set, the share of columns whose state the device keeps, whether the gradient streams to
the host during backward (training unchanged; it implies accumulate_on="host"), and the host
moments' dtype (where the host's memory binds)."""


def fitting_zenflow(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                    sharding: str = "ddp") -> Prediction | None:
    """Among the leaner variants of ``config`` (:data:`LEAN_CHOICES`) that fit the device's
    and the host's memory, the one that gives up least, or None when none fits: the highest
    ``topk_ratio`` first, then the dense set kept, then fp32 host moments, then an fp32
    accumulator, then device accumulation, and among equals the fastest. A prediction, not a
    measurement: the quality of a leaner setting is the convergence study's to say."""
    import itertools

    cfg = zenflow_config(config)
    ranked = []
    for values in itertools.product(*LEAN_CHOICES.values()):
        c = cfg.replace(**{k: v for k, v in zip(LEAN_CHOICES, values) if v is not None})
        if not memory_fits(hw, wl, "zenflow", gpus=gpus, config=c, sharding=sharding):
            continue
        p = predict(hw, wl, "zenflow", gpus=gpus, config=c, sharding=sharding)
        if p.fits:
            given_up = (cfg.topk_ratio - c.topk_ratio, c.dense_params != cfg.dense_params,
                        c.host_state_dtype != cfg.host_state_dtype,
                        c.accumulator_dtype != cfg.accumulator_dtype,
                        c.accumulate_on != cfg.accumulate_on,
                        c.stream_grads != cfg.stream_grads, p.step_time_s)
            ranked.append((given_up, p))
    return min(ranked, key=lambda r: r[0])[1] if ranked else None


def lean_changes(lean: Prediction, config: Any = None) -> dict[str, Any]:
    """The :data:`LEAN_CHOICES` settings in which ``lean`` (from :func:`fitting_zenflow`)
    differs from ``config``."""
    cfg = zenflow_config(config)
    return {k: lean.settings[k] for k in LEAN_CHOICES if lean.settings.get(k) != getattr(cfg, k)}


def params_and_grads_bytes(wl: Workload, *, gpus: int = 1, sharding: str = "ddp") -> int:
    """What no optimizer mode can offload: each GPU's params (in the model's dtype; 1/N of
    them under FSDP2), two buckets of its largest matrix's gradient and the step's
    activations (``activations``): the floor of a mode that streams gradients off."""
    share = gpus if sharding == "fsdp2" else 1
    largest = max((p.numel for p in wl.params if len(p.shape) == 2), default=0)
    acts = sum(activation_bytes(wl, wl.recompute).values())
    return int((wl.numel + 2 * largest) * wl.param_bytes / share + acts)
