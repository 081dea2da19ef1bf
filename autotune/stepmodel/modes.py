"""The modes, each a small dependency graph of one training step on the four lanes: AdamW on
the device, ZeRO-Offload (synchronous), ZeRO-Offload with a one-step delayed update,
exact AdamW overlapped per layer, and this library's ZenFlow step (selective AdamW on the
device, a windowed host update, optionally overlapped with the next window)."""

from __future__ import annotations

from typing import Any

from .base import _DTYPE_BYTES, DEVICE_ADAMW_BYTES_PER_ELEMENT, HOST_ADAM_BYTES_PER_ELEMENT
from .costs import _Costs
from .settings import _k
from .timeline import _Lanes, _run_windows
from .workload import Workload


def _adamw(c: _Costs, K: int):
    opt = c.total / c.n_gpus * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm
    F, B = sum(c.fwd), sum(c.bwd)

    def body(L: _Lanes, w: int, i: int) -> float:
        start = L.free["device"]
        L.run("device", F, "forward")
        L.run("device", B, "backward")
        L.run("device", opt, "AdamW (device)")
        return start

    return _run_windows(body, K)


def _small_adam(c: _Costs) -> float:
    return c.small / c.shard * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm


def _zero_offload(c: _Costs, K: int):
    """Synchronous: backward, device AdamW of the small params, gradient down, host AdamW of
    every offloaded element, params up, then the next forward."""
    P = sum(c.matrix) / c.n_gpus
    F, B, small = sum(c.fwd), sum(c.bwd), _small_adam(c)
    down, up, host = P * c.b / c.BL, P * c.b / c.BL, P / c.R

    def body(L: _Lanes, w: int, i: int) -> float:
        start = L.free["device"]
        L.run("device", F, "forward")
        L.run("device", B, "backward")
        t = L.run("device", small, "AdamW small params (device)")
        t = L.run("link-down", down, "grads down", [t])
        t = L.run("host", host, "host AdamW", [t])
        t = L.run("link-up", up, "params up", [t])
        L.run("device", 0.0, "wait", [t])
        return start

    return _run_windows(body, K)


def _zero_offload_dpu(c: _Costs, K: int):
    """One-step delayed parameter update (DeepSpeed's DPU): step t's host step overlaps step
    t+1's compute; step t+2's forward waits for step t's params, step t+1's backward for
    step t's gradient copy (the gradient buffer is reused)."""
    P = sum(c.matrix) / c.n_gpus
    F, B, small = sum(c.fwd), sum(c.bwd), _small_adam(c)
    down, up, host = P * c.b / c.BL, P * c.b / c.BL, P / c.R
    def body(L: _Lanes, w: int, i: int) -> float:
        m = L.marks  # "up-2": params of two steps back up; "down-1": last gradient copied
        start = L.run("device", 0.0, "wait", [m.get("up-2", 0.0)])
        L.run("device", F, "forward")
        L.run("device", 0.0, "wait", [m.get("down-1", 0.0)])
        L.run("device", B, "backward")
        t = L.run("device", small, "AdamW small params (device)")
        t = L.run("link-down", down, "grads down", [t])
        m["down-1"] = t
        t = L.run("host", host, "host AdamW", [t])
        m["up-2"] = m.get("up-1", 0.0)
        m["up-1"] = L.run("link-up", up, "params up", [t])
        return start

    return _run_windows(body, K)


def _overlapped_offload(c: _Costs, K: int):
    """Exact AdamW, pipelined per layer: as soon as backward has produced a layer's
    gradient it goes down, the host updates that layer, its params go up; the next forward
    of a layer waits for its params, the next backward of a layer for its gradient copy."""
    n = len(c.fwd)
    down = [m / c.n_gpus * c.b / c.BL for m in c.matrix]
    host = [m / c.n_gpus / c.R for m in c.matrix]
    small = _small_adam(c)
    def body(L: _Lanes, w: int, i: int) -> float:
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
                m[("ready", l)] = L.run("link-up", down[l], "params up", [t])
        L.run("device", small, "AdamW small params (device)")
        return start

    return _run_windows(body, K)


def _zenflow(c: _Costs, K: int, wl: Workload, cfg: Any, prefetch_result: bool):
    """This library's step (docs/design.md, "The step"), per GPU. Device each step: forward,
    backward, selective AdamW on the device-owned columns and the small params, the
    amortised column scoring of a selection, and (accumulate_on="device") the window sum.
    At a boundary: the window mean is cast to the param dtype on the device and copied down,
    the host updates, the result is copied up and scattered into the params: at once
    (overlap=False), or at the end of the step ``apply_delay`` steps later (overlap=True;
    the next boundary by default; the up copy is issued there, at the apply point, unless
    ``prefetch_result``)."""
    n = c.n_gpus
    g = b = c.b
    a = _DTYPE_BYTES[cfg.accumulator_dtype]
    e_dev = e_host = 0.0
    for p in wl.params:
        if p.is_matrix(cfg.min_offload_numel, cfg.dense_params):
            k = _k(cfg.topk_ratio, p.cols)
            e_dev += p.shape[0] * k
            e_host += p.shape[0] * (p.cols - k)
    h = e_host / n                                  # this rank's host-owned elements
    F, B = sum(c.fwd), sum(c.bwd)
    windowed = K > 1 and h > 0
    on_host = windowed and cfg.accumulate_on == "host"
    selects = 0 < cfg.topk_ratio < 1
    # Under FSDP2 this GPU updates, scores and scatters its own rows only (c.shard = N);
    # under DDP every GPU does the whole device half and scatters every gathered row.
    dev_update = (c.small + e_dev) / c.shard * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm
    score = (sum(c.matrix) / c.shard * g / c.Bm / cfg.effective_select_interval
             if selects else 0.0)
    acc = h * (g + 2 * a) / c.Bm if windowed and not on_host else 0.0
    gather = h * 2 * g / c.Bm if on_host else 0.0
    mean = h * (a + b) / c.Bm if windowed and not on_host else 0.0
    scatter = e_host / c.shard * 2 * b / c.Bm if cfg.topk_ratio > 0 and h > 0 else 0.0
    down_window = h * (b if windowed else g) / c.BL if not on_host else 0.0
    down_step = h * g / c.BL if on_host else 0.0
    host_add = h * (g + 2 * a) / HOST_ADAM_BYTES_PER_ELEMENT / c.R if on_host else 0.0
    host_adam = h / c.R
    up = h * b / c.BL
    delay = min(cfg.effective_apply_delay, K)  # K = 1: every step is a boundary
    def body(L: _Lanes, w: int, i: int) -> float:
        state = L.marks
        start = L.free["device"]
        L.run("device", F, "forward")
        L.run("device", B, "backward")
        t = L.run("device", dev_update, "selective AdamW (device)")
        if score:
            t = L.run("device", score, "column scoring (amortised)")
        if acc:
            t = L.run("device", acc, "accumulate", [state.get("copy_in", 0.0)] if i == 0 else [])
        if on_host:
            t = L.run("device", gather, "gather host columns")
            d = L.run("link-down", down_step, "grads down", [t])
            state["last_add"] = L.run("host", host_add, "host accumulate", [d])
        if cfg.overlap and h > 0 and i == delay - 1 and "job_host_end" in state:
            # the apply point of the previous window: at its end, or apply_delay steps in
            after = [state["job_host_end"]] + ([] if prefetch_result else [t])
            u = L.run("link-up", up, "params up", after)
            t = L.run("device", scatter, "apply (scatter)", [u])
        if i != K - 1 or h == 0:
            return start
        # window boundary
        if mean:
            t = L.run("device", mean, "window mean -> bf16")
        if on_host:
            ready = state.get("last_add", 0.0)
        else:
            ready = L.run("link-down", down_window, "grads down", [t])
            state["copy_in"] = ready
        hend = L.run("host", host_adam, "host AdamW", [ready])
        if cfg.overlap:
            state["job_host_end"] = hend
            if not windowed:  # a .grad source: the training stream waits for the copy
                L.run("device", 0.0, "wait", [ready])
        else:
            u = L.run("link-up", up, "params up", [hend])
            L.run("device", scatter, "apply (scatter)", [u])
        return start

    lanes_starts = _run_windows(body, K)
    drain = 0.0
    if selects and cfg.overlap and h > 0:
        # A selection (every select_interval steps) first drains the job launched at the
        # previous step, which has had only one step's compute to hide behind; the boundary
        # that would have applied it then has nothing to wait for. Net extra, amortised:
        job = (down_step + host_add if on_host else down_window) + host_adam
        per_step = F + B + dev_update + score + acc + gather
        # what the apply point would have hidden the job behind: apply_delay steps
        hidden = K * per_step + mean + scatter if delay == K else delay * per_step
        drain = ((max(0.0, job - (F + B)) - max(0.0, job - hidden))
                 / cfg.effective_select_interval)
    return lanes_starts, drain, {"device_owned_elements": e_dev, "host_owned_elements": e_host,
                                 "link_down_per_window": (h * (b if windowed else g)
                                                          if not on_host else K * h * g),
                                 "link_up_per_window": h * b}
