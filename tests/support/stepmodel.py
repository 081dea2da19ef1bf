"""A hand-computable accelerator for the step model's tests: 1 TFLOP/s, 100 GB/s of device
memory bandwidth, a 1 GB/s link each way, a host AdamW of 1e9 elements/s, no memory limit."""

from __future__ import annotations

from autotune import stepmodel as S


def toy_hardware(**kw) -> S.Hardware:
    base = dict(name="test", device_flops=1e12, device_memory_bandwidth=1e11,
                link_bandwidth=1e9, device_memory_bytes=None, host_adam_elements_per_s=1e9,
                accelerators_per_node=8)
    base.update(kw)
    return S.Hardware(**base)
