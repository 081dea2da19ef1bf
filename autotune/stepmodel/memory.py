"""The memory each side needs per mode, by the optimizer's own byte accounting (README,
"Memory"): params, grads and optimizer state on the device; master weights, moments,
outbox, window accumulator, column indices and worker scratch on the host. Under FSDP2 the
device's params, grads and state are this GPU's rows (1/N); the column indices are whole
on every GPU (every rank makes the same selection)."""

from __future__ import annotations

from typing import Any

from .base import _DTYPE_BYTES, INDEX_BYTES, SCRATCH_BYTES_PER_THREAD
from .costs import _Costs
from .settings import _k
from .workload import Workload


def _memory(mode: str, wl: Workload, c: _Costs, cfg: Any, threads: int) -> dict[str, dict]:
    b, n, d = c.b, c.n_gpus, c.shard       # d: N under FSDP2 (this GPU's rows), else 1
    master = 12 if b < 4 else 8            # fp32 master (a bf16 param needs one), m, v
    dev: dict[str, float] = {"params": c.total * b / d, "grads": c.total * b / d}
    host: dict[str, float] = {}
    P = sum(c.matrix)
    s = _DTYPE_BYTES[cfg.host_state_dtype]
    scratch = threads * SCRATCH_BYTES_PER_THREAD
    moment_scratch = 2 * scratch if s < 4 else 0
    if mode == "adamw":
        dev["optimizer state (sharded 1/N)"] = c.total * master / n
    else:
        dev["small params' AdamW state"] = c.small * master / d
    if mode in ("zero-offload", "zero-offload-dpu", "overlapped-offload"):
        host["master + moments"] = P / n * (4 + 2 * s)
        host["worker scratch"] = scratch + moment_scratch
        if mode == "zero-offload-dpu" or (mode == "zero-offload" and n > 1):
            host["outbox (param dtype)"] = P / n * b
        if mode == "overlapped-offload":
            largest = max(c.matrix) / n
            host["per-layer staging (2 buffers each way)"] = 2 * largest * 2 * b
    elif mode == "zenflow":
        e_dev = e_host = 0.0
        idx = 0.0
        for p in wl.params:
            if not p.is_matrix(cfg.min_offload_numel, cfg.dense_params):
                continue
            k = _k(cfg.topk_ratio, p.cols)
            rows = p.shape[0]
            e_dev += rows * k
            e_host += rows * (p.cols - k)
            if k > 0:
                idx += p.cols * INDEX_BYTES
        a = _DTYPE_BYTES[cfg.accumulator_dtype]
        dev["device-owned columns' AdamW state"] = e_dev * master / d
        dev["column indices"] = idx
        windowed = cfg.update_interval > 1 and e_host > 0
        if windowed and cfg.accumulate_on == "device":
            dev["window accumulator (rank's rows)"] = e_host / n * a
        host["master + moments"] = e_host / n * (4 + 2 * s)
        if e_host and (cfg.overlap or cfg.topk_ratio > 0 or n > 1):
            host["outbox (param dtype)"] = e_host / n * b
        if windowed and cfg.accumulate_on == "host":
            host["window accumulator (rank's rows)"] = e_host / n * a
        host["column indices"] = idx
        if e_host:
            host["worker scratch"] = scratch + moment_scratch
    return {"device": dev, "host": host}
