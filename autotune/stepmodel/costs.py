"""The durations and element counts one GPU's process sees: each layer's forward and backward
time on the accelerator (FLOPs over MFU x peak), the offloadable and small params'
elements, the bandwidths and host rate the modes divide by, and how much of the device
state this GPU holds (all of it under DDP, 1/N under FSDP2)."""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware
from .workload import Workload


@dataclass(frozen=True)
class _Costs:
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
    BL: float
    R: float                        # host AdamW elements/s for this process


def _costs(hw: Hardware, wl: Workload, gpus: int, min_offload_numel: int,
           dense_params: tuple[str, ...] = (), sharding: str = "ddp") -> _Costs:
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
    return _Costs(gpus, gpus if sharding == "fsdp2" else 1, tuple(fwd), tuple(bwd),
                  tuple(matrix), float(small), float(wl.numel),
                  wl.param_bytes, hw.device_memory_bandwidth, hw.link_bandwidth,
                  hw.host_rate(gpus))
