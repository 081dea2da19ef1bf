"""The modes, each a small dependency graph of one training step on the four lanes: AdamW on
the device, ZeRO-Offload (synchronous), ZeRO-Offload with a one-step delayed update,
exact AdamW overlapped per layer, state-swap (the Adam state kept in pinned host memory
and streamed through the device for an exact AdamW step every step, a fraction of it
resident), and this library's ZenFlow step (selective AdamW on the device, a windowed host
update, optionally overlapped with the next window); with what they are built from:

* :class:`Costs` (:func:`gpu_costs`): the durations and element counts one GPU's process
  sees: each layer's forward and backward time on the accelerator (FLOPs over MFU x
  peak), the offloadable and small params' elements, the bandwidths (the link's per
  direction, and how much of its rate a transfer keeps while the other direction is busy)
  and host rate the modes divide by, and how much of the device state this GPU holds (all
  of it under DDP, 1/N under FSDP2);
* :func:`zenflow_split`: the elements ZenFlow keeps on each side, by the optimizer's own
  column count (:func:`zenflow_triton.columns.selection.num_selected`);
* :func:`memory_use`: the memory each side needs per mode, by the optimizer's own byte
  accounting (README, "Memory"): params, grads and optimizer state on the device; master
  weights, moments, outbox, window accumulator, column indices and worker scratch on the
  host. Under FSDP2 the device's params, grads and state are this GPU's rows (1/N); the
  column indices are whole on every GPU (every rank makes the same selection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zenflow_triton.columns.selection import num_selected
from zenflow_triton.fit import host_terms, streamed_gradient_bytes

from .inputs import (DEVICE_ADAMW_BYTES_PER_ELEMENT, DTYPE_BYTES, HOST_ADAM_BYTES_PER_ELEMENT,
                     INDEX_BYTES, SCRATCH_BYTES_PER_THREAD, STATE_SWAP_CHUNK_ELEMENTS, Hardware)
from .workload import Workload
from .activations import activation_bytes
from .timeline import Lanes, run_windows


# ---- what one GPU's process sees ------------------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """Every duration (s) and element count one GPU's process sees."""

    n_gpus: int
    shard: int                      # the device state's divisor: n_gpus under fsdp2, else 1
    fwd: tuple[float, ...]          # per layer, forward order
    bwd: tuple[float, ...]
    matrix: tuple[float, ...]       # per layer: offloadable elements (all ranks)
    small: float                    # device-owned small params' elements
    total: float
    b: int                          # param (and grad) bytes
    Bm: float
    BL_down: float                  # B/s device to host ("link-down"), the other way idle
    BL_up: float                    # B/s host to device ("link-up"), the other way idle
    R: float                        # host AdamW elements/s for this process
    contention: dict[str, float]    # per link lane: rate kept while the other way is busy
    micro: int = 1                  # forward/backward passes per optimizer step


def gpu_costs(hw: Hardware, wl: Workload, gpus: int, min_offload_numel: int,
           dense_params: tuple[str, ...] = (), sharding: str = "ddp") -> Costs:
    hw.require_device()
    peak = hw.device_flops if wl.dtype != "float32" else (hw.device_flops_fp32
                                                           or hw.device_flops)
    rate = wl.mfu * peak
    fwd, bwd, matrix = [], [], []
    small = 0
    for layer in wl.layers:
        c = layer.flops_per_token * wl.tokens / rate
        fwd.append(c / 3.0)
        bwd.append(c * 2.0 / 3.0)
        split = [p.is_matrix(min_offload_numel, dense_params) for p in layer.params]
        matrix.append(float(sum(p.numel for p, s in zip(layer.params, split) if s)))
        small += sum(p.numel for p, s in zip(layer.params, split) if not s)
    return Costs(gpus, gpus if sharding == "fsdp2" else 1, tuple(fwd), tuple(bwd),
                  tuple(matrix), float(small), float(wl.numel),
                  wl.param_bytes, hw.device_memory_bandwidth, hw.d2h, hw.h2d,
                  hw.host_rate(gpus), hw.link_contention(), wl.micro_batches)


def zenflow_split(wl: Workload, cfg: Any) -> tuple[float, float, float]:
    """ZenFlow's elements of the split matrices (all ranks): device-owned (the selected
    columns, as the optimizer counts them), host-owned (the rest), and the bytes of their
    column indices."""
    e_dev = e_host = 0.0
    idx = 0.0
    for p in wl.params:
        if not p.is_matrix(cfg.min_offload_numel, cfg.dense_params):
            continue
        k = num_selected(p.cols, cfg.topk_ratio)
        rows = p.shape[0]
        e_dev += rows * k
        e_host += rows * (p.cols - k)
        if k > 0:
            idx += p.cols * INDEX_BYTES
    return e_dev, e_host, idx


def state_bytes(c: Costs) -> int:
    """Bytes of Adam state per element that state-swap moves each way: fp32 master, m and v
    (12), or m and v (8) for an fp32 param, which is its own master."""
    return 12 if c.b < 4 else 8


def swap_chunks(c: Costs, resident: float) -> list[float]:
    """State-swap's streamed chunks (elements) of this GPU's share (1/N: the state is sharded
    over the GPUs as in ZeRO-1/2) less the ``resident`` share: equal chunks of at most
    :data:`STATE_SWAP_CHUNK_ELEMENTS` over the flat state (equal, so that no chunk waits for
    a larger one's buffer)."""
    total = sum(c.matrix) / c.n_gpus * (1.0 - resident)
    if total <= 0:
        return []
    n = math.ceil(total / STATE_SWAP_CHUNK_ELEMENTS)
    return [total / n] * n


def largest_matrix(wl: Workload, cfg: Any, dense: tuple[str, ...] | None = None) -> float:
    """Elements of the largest offloaded matrix (``dense``: the dense set kept whole, by
    default ``cfg``'s)."""
    dense = cfg.dense_params if dense is None else dense
    return float(max((p.numel for p in wl.params
                      if p.is_matrix(cfg.min_offload_numel, dense)), default=0))


def _gradients(mode: str, wl: Workload, c: Costs, cfg: Any) -> dict[str, float]:
    """The gradient bytes resident on the device at their peak. AdamW and state-swap keep
    the whole gradient; ZeRO-Offload and its variants stream it to the host bucket by
    bucket during backward (two buckets of the largest matrix: one filling, one in flight);
    ZenFlow with ``stream_grads`` keeps one matrix's gradient and the gather of its host
    columns, its device columns' gradient and, at a selection, the column scores; the small
    params keep theirs."""
    b, d = c.b, c.shard
    offloads = mode in ("zero-offload", "zero-offload-dpu", "overlapped-offload")
    if not (offloads or (mode == "zenflow" and cfg.stream_grads)):
        return {"grads": c.total * b / d}
    out = {"grads of the small params": c.small * b / d}
    if offloads:
        out["gradient buckets (2 x the largest matrix)"] = 2 * largest_matrix(wl, cfg, ()) * b / d
        return out
    mats = [(p.shape[0] / d, p.cols, num_selected(p.cols, cfg.topk_ratio), b)
            for p in wl.params if p.is_matrix(cfg.min_offload_numel, cfg.dense_params)]
    out.update({k: v for k, v in streamed_gradient_bytes(mats).items() if v})
    return out


NOT_OPTIMIZER_STATE = ("params", "grads", "gradient buckets", "streamed gradient",
                       "device columns' gradient", "column scores", "activations", "logits")
"""The prefixes of :func:`memory_use`'s device entries that are no optimizer state: the
params, gradients and activations."""


def optimizer_state_bytes(device: dict[str, float]) -> float:
    """The optimizer state among :func:`memory_use`'s device entries."""
    return sum(v for k, v in device.items() if not k.startswith(NOT_OPTIMIZER_STATE))


DEEPSPEED_FP32_GRADIENT = "fp32 gradient partition (DeepSpeed only)"
""":func:`zero_offload_host`'s entry for what DeepSpeed holds beyond this library's own
ZeRO-Offload mode."""


def zero_offload_host(mode: str, wl: Workload, c: Costs, cfg: Any,
                      threads: int) -> dict[str, float]:
    """The host bytes of ``zero-offload`` (``zero-offload-dpu``: its delayed update), by part:

    * this library's own ZeRO-Offload mode (``topk_ratio=0, update_interval=1``,
      ``overlap=False``, or ``True`` for the delayed update), as the optimizer allocates it
      (:func:`zenflow_triton.fit.host_terms`: master, moments, outbox, indices, scratch,
      bounce buffers), so that mode's prediction equals ZenFlow's at those settings;
    * what DeepSpeed ZeRO-1/2 with ``offload_optimizer: cpu`` holds beyond that
      (``deepspeed/runtime/zero/stage_1_and_2.py``): the fp32 gradient of its host partition,
      4 B per element (``single_partition_of_fp32_groups[i].grad``, written by
      ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``, pinned with
      ``offload_optimizer.pin_memory``), under :data:`DEEPSPEED_FP32_GRADIENT`; and, with
      several micro-batches, the gradient sum between them in the param dtype, pinned
      (``accumulated_grads_in_cpu``, ``async_accumulate_grad_in_cpu_via_gpu``). Its fp32
      master and moments are the library's own terms (``single_partition_of_fp32_groups``,
      the CPU Adam's ``exp_avg`` and ``exp_avg_sq``, fp32 whatever ``host_state_dtype``
      ZenFlow is given: the CPU Adam keeps its moments in its params' dtype, the fp32
      master's)."""
    n, b = c.n_gpus, c.b
    own = cfg.replace(topk_ratio=0.0, update_interval=1, overlap=mode == "zero-offload-dpu",
                      stream_grads=False, apply_delay=None, host_state_dtype="float32")
    mats = [(p.shape[0] / n, p.cols, 0, b) for p in wl.params
            if p.is_matrix(cfg.min_offload_numel, ())]
    out = {k: v for k, v in host_terms(mats, own, threads=threads, cuda=True,
                                       world=n).items() if v}
    out[DEEPSPEED_FP32_GRADIENT] = sum(c.matrix) / n * 4
    if c.micro > 1:  # DeepSpeed's accumulated_grads_in_cpu
        out["gradient sum between micro-batches (param dtype, pinned)"] = sum(c.matrix) / n * b
    return out


def memory_use(mode: str, wl: Workload, c: Costs, cfg: Any, threads: int,
               resident: float = 0.0) -> dict[str, dict]:
    b, n, d = c.b, c.n_gpus, c.shard       # d: N under FSDP2 (this GPU's rows), else 1
    master = 12 if b < 4 else 8            # fp32 master (a bf16 param needs one), m, v
    dev: dict[str, float] = {"params": c.total * b / d, **_gradients(mode, wl, c, cfg),
                             **activation_bytes(wl, wl.recompute)}
    host: dict[str, float] = {}
    P = sum(c.matrix)
    scratch = threads * SCRATCH_BYTES_PER_THREAD
    if mode == "adamw":
        dev["optimizer state (sharded 1/N)"] = c.total * master / n
    else:
        dev["small params' AdamW state"] = c.small * master / d
    if mode == "state-swap":
        sb = state_bytes(c)
        dev["resident Adam state (sharded 1/N)"] = P / n * resident * sb
        dev["two streaming buffers"] = 2 * max(swap_chunks(c, resident), default=0.0) * sb
        host["Adam state, pinned (sharded 1/N)"] = P / n * (1.0 - resident) * sb
    if mode in ("zero-offload", "zero-offload-dpu"):
        host.update(zero_offload_host(mode, wl, c, cfg, threads))
    if mode == "overlapped-offload":  # torch's AdamW on fp32 host copies: fp32 moments
        host["master + moments"] = P / n * (4 + 2 * 4)
        host["worker scratch"] = scratch
        largest = max(c.matrix) / n
        host["per-layer staging (2 buffers each way)"] = 2 * largest * 2 * b
    elif mode == "zenflow":
        e_dev, e_host, idx = zenflow_split(wl, cfg)
        a = DTYPE_BYTES[cfg.accumulator_dtype]
        dev["device-owned columns' AdamW state"] = e_dev * master / d
        dev["column indices"] = idx
        windowed = cfg.update_interval > 1 and e_host > 0
        if windowed and cfg.accumulate_on == "device":
            dev["window accumulator (rank's rows)"] = e_host / n * a
        mats = [(p.shape[0] / n, p.cols, num_selected(p.cols, cfg.topk_ratio), b)
                for p in wl.params if p.is_matrix(cfg.min_offload_numel, cfg.dense_params)]
        host.update({k: v for k, v in host_terms(mats, cfg, threads=threads, cuda=True,
                                                 world=n, micro_batches=c.micro).items() if v})
    return {"device": dev, "host": host}


# ---- the modes' graphs ---------------------------------------------------------------------
def adamw(c: Costs, K: int):
    opt = c.total / c.n_gpus * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm
    F, B = sum(c.fwd), sum(c.bwd)

    def body(L: Lanes, w: int, i: int) -> float:
        start = L.free["device"]
        L.run("device", F, "forward")
        L.run("device", B, "backward")
        L.run("device", opt, "AdamW (device)")
        return start

    return run_windows(body, K)  # nothing crosses the link


def _small_adam(c: Costs) -> float:
    return c.small / c.shard * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm




def offload_micro_batches(L: Lanes, c: Costs, F: float, B: float,
                          before_first_backward: float = 0.0) -> None:
    """The forward and backward passes of one optimizer step under DeepSpeed's ZeRO-1/2
    offload (``stage_1_and_2.py``, ``async_accumulate_grad_in_cpu_via_gpu``): the gradient
    sum of the micro-batches so far lives in pinned host memory in the param dtype; during
    each backward after the first, that sum is copied up and added on the device, and during
    each backward before the last, the new sum is copied back down; the device waits for
    those copies at the end of the backward (the next backward reuses the buffer). One
    micro-batch: no copies here (the step's fp32 copy follows the last backward)."""
    M, P = c.micro, sum(c.matrix) / c.n_gpus
    for j in range(M):
        L.run("device", F / M, "forward")
        in_backward = L.run("device", 0.0, "wait", [before_first_backward] if j == 0 else [])
        L.run("device", B / M, "backward")
        t = in_backward
        if j > 0:
            t = L.run("link-up", P * c.b / c.BL_up, "gradient sum up", [t])
        if j < M - 1:
            t = L.run("link-down", P * c.b / c.BL_down, "gradient sum down", [t])
        if M > 1:
            L.run("device", 0.0, "wait", [t])


def zero_offload(c: Costs, K: int):
    """Synchronous: the micro-batches' forward and backward (:func:`offload_micro_batches`),
    device AdamW of the small params, the gradient down (in the param dtype: DeepSpeed
    sends it in fp32, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``, so the model
    favours the peer by half a gradient's bytes; it is also this library's own ZeRO-Offload
    mode, ``topk_ratio=0, update_interval=1, overlap=False``, which sends the param dtype),
    host AdamW of every offloaded element, params up, then the next step's forward."""
    P = sum(c.matrix) / c.n_gpus
    F, B, small = sum(c.fwd), sum(c.bwd), _small_adam(c)
    down, up, host = P * c.b / c.BL_down, P * c.b / c.BL_up, P / c.R

    def body(L: Lanes, w: int, i: int) -> float:
        start = L.free["device"]
        offload_micro_batches(L, c, F, B)
        t = L.run("device", small, "AdamW small params (device)")
        t = L.run("link-down", down, "grads down", [t])
        t = L.run("host", host, "host AdamW", [t])
        t = L.run("link-up", up, "params up", [t])
        L.run("device", 0.0, "wait", [t])
        return start

    return run_windows(body, K, c.contention)


def zero_offload_dpu(c: Costs, K: int):
    """One-step delayed parameter update (DeepSpeed's DPU): step t's host step overlaps step
    t+1's compute; step t+2's forward waits for step t's params, step t+1's first backward
    for step t's gradient copy (the gradient buffer is reused); micro-batches as in
    :func:`offload_micro_batches`."""
    P = sum(c.matrix) / c.n_gpus
    F, B, small = sum(c.fwd), sum(c.bwd), _small_adam(c)
    down, up, host = P * c.b / c.BL_down, P * c.b / c.BL_up, P / c.R
    def body(L: Lanes, w: int, i: int) -> float:
        m = L.marks  # "up-2": params of two steps back up; "down-1": last gradient copied
        start = L.run("device", 0.0, "wait", [m.get("up-2", 0.0)])
        offload_micro_batches(L, c, F, B, before_first_backward=m.get("down-1", 0.0))
        t = L.run("device", small, "AdamW small params (device)")
        t = L.run("link-down", down, "grads down", [t])
        m["down-1"] = t
        t = L.run("host", host, "host AdamW", [t])
        m["up-2"] = m.get("up-1", 0.0)
        m["up-1"] = L.run("link-up", up, "params up", [t])
        return start

    return run_windows(body, K, c.contention)


def overlapped_offload(c: Costs, K: int):
    """Exact AdamW, pipelined per layer: as soon as backward has produced a layer's
    gradient it goes down, the host updates that layer, its params go up; the next forward
    of a layer waits for its params, the next backward of a layer for its gradient copy."""
    n = len(c.fwd)
    down = [m / c.n_gpus * c.b / c.BL_down for m in c.matrix]
    up = [m / c.n_gpus * c.b / c.BL_up for m in c.matrix]
    host = [m / c.n_gpus / c.R for m in c.matrix]
    small = _small_adam(c)
    def body(L: Lanes, w: int, i: int) -> float:
        m = L.marks  # ("ready", l): layer l's params up; ("copied", l): its gradient down
        start = None
        for l in range(n):
            t = L.run("device", 0.0, "wait", [m.get(("ready", l), 0.0)])
            start = t if start is None else start
            L.run("device", c.fwd[l], "forward")
        for l in reversed(range(n)):
            L.run("device", 0.0, "wait", [m.get(("copied", l), 0.0)])
            t = L.run("device", c.bwd[l], "backward")
            if c.matrix[l] > 0:
                t = L.run("link-down", down[l], "grads down", [t])
                m[("copied", l)] = t
                t = L.run("host", host[l], "host AdamW", [t])
                m[("ready", l)] = L.run("link-up", up[l], "params up", [t])
        L.run("device", small, "AdamW small params (device)")
        return start

    return run_windows(body, K, c.contention)


def state_swap(c: Costs, K: int, resident: float):
    """Exact AdamW every step with the Adam state in pinned host memory (this GPU's 1/N):
    after backward, the small params' and the resident state's AdamW on the device, then
    chunk after chunk: the state goes up, AdamW updates it and the params on the device, the
    state goes down. Two buffers: a chunk goes up once the chunk two before it is down (so
    the first two of a step go up during the forward and backward), and the last ones go
    down during the next forward. Link-bound: 2 x 12 bytes per offloaded element, each way
    its own lane, and the two ways mostly at once (each at its contended figure)."""
    F, B = sum(c.fwd), sum(c.bwd)
    sb = state_bytes(c)
    chunks = swap_chunks(c, resident)
    on_device = (_small_adam(c) + sum(c.matrix) / c.n_gpus * resident
                 * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm)

    def body(L: Lanes, w: int, i: int) -> float:
        m = L.marks  # ("free", b): when streaming buffer b is free again
        start = L.free["device"]
        L.run("device", F, "forward")
        L.run("device", B, "backward")
        L.run("device", on_device, "AdamW resident state (device)")
        for j, e in enumerate(chunks):
            up = L.run("link-up", e * sb / c.BL_up, "state up",
                       [m.get(("free", j % 2), 0.0)])
            t = L.run("device", e * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm,
                      "AdamW streamed chunk (device)", [up])
            m[("free", j % 2)] = L.run("link-down", e * sb / c.BL_down, "state down", [t])
        return start

    return run_windows(body, K, c.contention)


def zenflow(c: Costs, K: int, wl: Workload, cfg: Any, prefetch_result: bool):
    """This library's step (docs/design.md, "The step"), per GPU. Device each step: forward,
    backward, selective AdamW on the device-owned columns and the small params, the
    amortised column scoring of a selection, and (accumulate_on="device") the window sum.
    At a boundary: the window mean is cast to the param dtype on the device and copied down,
    the host updates, the result is copied up and scattered into the params: at once
    (overlap=False), or at the end of the step ``apply_delay`` steps later (overlap=True;
    the next boundary by default; the up copy is issued there, at the apply point, unless
    ``prefetch_result``). Returns the scheduled windows, the amortised extra time per step
    of a reselection, and the elements and link bytes per window."""
    e_dev, e_host, _ = zenflow_split(wl, cfg)
    z = _zenflow_tasks(c, K, e_dev, e_host, cfg)
    g = b = c.b
    lanes_starts = run_windows(_zenflow_body(z, K, cfg, prefetch_result), K, c.contention)
    return lanes_starts, _reselection_drain(z, K, cfg), {
        "device_owned_elements": e_dev, "host_owned_elements": e_host,
        "link_down_per_window": (z.h * (b if z.windowed else g) if not z.on_host
                                 else K * z.h * g * (z.M if z.streams else 1)),
        "link_up_per_window": z.h * b}


@dataclass(frozen=True)
class _ZenFlowTasks:
    """One GPU's ZenFlow step: the duration (s) of each task, and which tasks there are."""

    h: float                # this rank's host-owned elements
    F: float                # forward, backward (all micro-batches of a step)
    B: float
    M: int                  # micro-batches per step
    windowed: bool          # a window of several steps with host-owned elements
    on_host: bool           # accumulate_on="host"
    streams: bool           # stream_grads: the host columns go down during backward
    selects: bool           # 0 < topk_ratio < 1: selections happen
    dev_update: float
    score: float
    acc: float
    gather: float
    mean: float
    scatter: float
    down_window: float
    down_step: float
    host_add: float
    host_adam: float
    up: float
    delay: int              # apply_delay, at most the window


def _zenflow_tasks(c: Costs, K: int, e_dev: float, e_host: float, cfg: Any) -> _ZenFlowTasks:
    n = c.n_gpus
    g = b = c.b
    a = DTYPE_BYTES[cfg.accumulator_dtype]
    h = e_host / n                                  # this rank's host-owned elements
    windowed = K > 1 and h > 0
    streams = bool(cfg.stream_grads) and h > 0
    # summed on the host: a window's steps, or (streamed) a step's micro-batches
    on_host = (windowed and cfg.accumulate_on == "host") or (streams and c.micro > 1)
    selects = 0 < cfg.topk_ratio < 1
    # Under FSDP2 this GPU updates, scores and scatters its own rows only (c.shard = N);
    # under DDP every GPU does the whole device half and scatters every gathered row.
    return _ZenFlowTasks(
        h=h, F=sum(c.fwd), B=sum(c.bwd), M=c.micro, windowed=windowed, on_host=on_host,
        selects=selects, streams=streams,
        dev_update=(c.small + e_dev) / c.shard * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm,
        score=(sum(c.matrix) / c.shard * g / c.Bm / cfg.effective_select_interval
               if selects else 0.0),
        acc=h * (g + 2 * a) / c.Bm if windowed and not on_host else 0.0,
        gather=h * 2 * g / c.Bm if on_host else 0.0,
        mean=h * (a + b) / c.Bm if windowed and not on_host else 0.0,
        scatter=e_host / c.shard * 2 * b / c.Bm if cfg.topk_ratio > 0 and h > 0 else 0.0,
        down_window=h * (b if windowed else g) / c.BL_down if not on_host else 0.0,
        down_step=h * g / c.BL_down if on_host else 0.0,
        host_add=h * (g + 2 * a) / HOST_ADAM_BYTES_PER_ELEMENT / c.R if on_host else 0.0,
        host_adam=h / c.R,
        up=h * b / c.BL_up,
        delay=min(cfg.effective_apply_delay, K))  # K = 1: every step is a boundary


def _zenflow_body(z: _ZenFlowTasks, K: int, cfg: Any, prefetch_result: bool):
    """Step ``i`` of a window on the lanes (for :func:`~.timeline.run_windows`)."""

    def body(L: Lanes, w: int, i: int) -> float:
        state = L.marks
        start = L.free["device"]
        # micro-batches before the step's last: autograd sums .grad on the device, or
        # (streamed) each backward sends its host columns down and the host adds them up
        for _ in range(z.M - 1 if z.streams else 0):
            in_backward = L.run("device", z.F / z.M, "forward")
            L.run("device", z.B / z.M, "backward")
            L.run("device", z.gather, "gather host columns")
            d = L.run("link-down", z.down_step, "grads down", [in_backward])
            state["last_add"] = L.run("host", z.host_add, "host accumulate", [d])
        if z.M > 1 and not z.streams:  # nothing but the device lane: one task for them all
            L.run("device", (z.F + z.B) * (z.M - 1) / z.M, "forward + backward (micro-batches)")
        in_backward = L.run("device", z.F / z.M, "forward")
        L.run("device", z.B / z.M, "backward")
        t = L.run("device", z.dev_update, "selective AdamW (device)")
        # streamed: each matrix's host columns leave as backward makes them
        copy_from = in_backward if z.streams else None
        if z.score:
            t = L.run("device", z.score, "column scoring (amortised)")
        if z.acc:
            t = L.run("device", z.acc, "accumulate",
                      [state.get("copy_in", 0.0)] if i == 0 else [])
        if z.on_host:
            t = L.run("device", z.gather, "gather host columns")
            d = L.run("link-down", z.down_step, "grads down",
                      [t if copy_from is None else copy_from])
            state["last_add"] = L.run("host", z.host_add, "host accumulate", [d])
        if cfg.overlap and z.h > 0 and i == z.delay - 1 and "job_host_end" in state:
            # the apply point of the previous window: at its end, or apply_delay steps in
            after = [state["job_host_end"]] + ([] if prefetch_result else [t])
            u = L.run("link-up", z.up, "params up", after)
            t = L.run("device", z.scatter, "apply (scatter)", [u])
        if i != K - 1 or z.h == 0:
            return start
        # window boundary
        if z.mean:
            t = L.run("device", z.mean, "window mean -> bf16")
        if z.on_host:
            ready = state.get("last_add", 0.0)
        else:
            ready = L.run("link-down", z.down_window, "grads down",
                          [t if copy_from is None else copy_from])
            state["copy_in"] = ready
        hend = L.run("host", z.host_adam, "host AdamW", [ready])
        if cfg.overlap:
            state["job_host_end"] = hend
            if not z.windowed:  # a .grad source: the training stream waits for the copy
                L.run("device", 0.0, "wait", [ready])
        else:
            u = L.run("link-up", z.up, "params up", [hend])
            L.run("device", z.scatter, "apply (scatter)", [u])
        return start

    return body


def _reselection_drain(z: _ZenFlowTasks, K: int, cfg: Any) -> float:
    """A selection (every select_interval steps) first drains the job launched at the
    previous step, which has had only one step's compute to hide behind; the boundary that
    would have applied it then has nothing to wait for. The net extra per step, amortised."""
    if not (z.selects and cfg.overlap and z.h > 0):
        return 0.0
    job = (z.down_step + z.host_add if z.on_host else z.down_window) + z.host_adam
    per_step = z.F + z.B + z.dev_update + z.score + z.acc + z.gather
    # what the apply point would have hidden the job behind: apply_delay steps
    hidden = K * per_step + z.mean + z.scatter if z.delay == K else z.delay * per_step
    return ((max(0.0, job - (z.F + z.B)) - max(0.0, job - hidden))
            / cfg.effective_select_interval)
