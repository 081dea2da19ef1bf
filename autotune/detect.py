"""What hardware the tuner sees (``zenflow-tune detect``) and which built-in profile it matches,
and how fast this machine's host AdamW runs. (A hardware profile's facts, as the step-time
model reads them, are :class:`autotune.stepmodel.Hardware`.)"""

from __future__ import annotations

import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .names import slug

__all__ = ["detect", "matching_builtin", "hardware_slug", "measure_host_adam",
           "host_adam_times", "host_adam_settings", "usable_cpus"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask on Linux), at least 1."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _host_memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _pcie_link(index: int) -> dict[str, Any] | None:
    """PCIe link of CUDA device ``index`` from sysfs (Linux), if visible."""
    try:
        bus = torch.cuda.get_device_properties(index).pci_bus_id  # type: ignore[attr-defined]
    except Exception:
        return None
    dev = Path("/sys/bus/pci/devices") / str(bus).lower()
    try:
        speed = (dev / "current_link_speed").read_text().strip()
        width = (dev / "current_link_width").read_text().strip()
        return {"current_link_speed": speed, "current_link_width": width}
    except OSError:
        return None


def detect() -> dict[str, Any]:
    """Facts about this machine: host CPU, accelerator(s), library versions."""
    info: dict[str, Any] = {
        "host": {
            "cpu": _cpu_model(),
            "usable_cpus": usable_cpus(),
            "torch_threads": torch.get_num_threads(),
            "memory_gb": _host_memory_gb(),
            "platform": platform.platform(),
        },
        "accelerators": [],
        "versions": versions(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            acc = {"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 1),
                   "capability": f"{p.major}.{p.minor}",
                   "multiprocessors": p.multi_processor_count,
                   "runtime": "rocm" if getattr(torch.version, "hip", None) else "cuda"}
            link = _pcie_link(i)
            if link:
                acc["pcie"] = link
            info["accelerators"].append(acc)
    info["matching_profile"] = matching_builtin(info)
    return info


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("zenflow_triton", "optuna", "triton"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "unknown")
        except Exception:
            out[mod] = "not installed"
    return out


_PATTERNS = [
    (r"GH200", "gh200"),  # before H200, which "GH200" also contains
    (r"H200", "h200-sxm"),
    (r"H100.*(PCIe|NVL)", "h100-pcie5"),
    (r"H100", "h100-sxm5"),
    (r"A100.*PCIe", "a100-pcie4"),
    (r"A100", "a100-sxm4"),
    (r"L40S", "l40s-pcie4"),
    (r"4090", "rtx4090-pcie4"),
    (r"3090", "rtx3090-pcie4"),
]


def matching_builtin(info: dict[str, Any] | None = None) -> str | None:
    """The built-in profile for the first accelerator (``"cpu"`` without one), if any."""
    info = info if info is not None else {"accelerators": []}
    accs = info.get("accelerators") or []
    if not accs:
        return "cpu"
    name = accs[0]["name"]
    for pat, prof in _PATTERNS:
        if re.search(pat, name, re.IGNORECASE):
            return prof
    return None


def hardware_slug(info: dict[str, Any]) -> str:
    """Short lowercase name of the machine for default study/profile names."""
    m = info.get("matching_profile")
    if m:
        return m
    name = info["accelerators"][0]["name"] if info.get("accelerators") else "cpu"
    return slug(name, 40, keep="", strip="-", fallback="device")


def host_adam_settings(threads: int | None = None,
                       chunk_size: int | None = None) -> dict[str, Any]:
    """How :func:`measure_host_adam` runs the host AdamW: the implementation, and the thread
    count and chunk size ``ZenFlowOptimizer`` uses by default (``ZenFlowConfig``'s
    ``host_threads``, None = ``torch.get_num_threads()``, and ``chunk_size``) unless given."""
    from zenflow_triton import ZenFlowConfig

    cfg = ZenFlowConfig()
    threads = threads if threads is not None else (cfg.host_threads
                                                   or max(1, torch.get_num_threads()))
    chunk_size = chunk_size if chunk_size is not None else cfg.chunk_size
    return {"impl": "zenflow_triton.host.HostAdamW", "threads": threads,
            "chunk_size": chunk_size}


def measure_host_adam(numel: int = 1 << 24, repeats: int = 5, *, threads: int | None = None,
                      chunk_size: int | None = None, warmup: int = 1) -> float:
    """Elements per second of the library's host AdamW, :class:`zenflow_triton.host.HostAdamW`
    (the pool ``ZenFlowOptimizer`` runs its host-owned columns on), fp32.

    One ``update_many`` call on one set of fp32 (master, grad, m, v) CPU buffers of ``numel``
    elements (default 2^24: 64 MiB each, beyond the CPU caches as the host columns of a real
    model are), with the optimizer's default window (``grad_divisor`` = ``update_interval``),
    on ``threads`` workers with pieces of at most ``chunk_size`` elements (defaults: what the
    optimizer uses, see :func:`host_adam_settings`). ``warmup`` untimed calls, then the
    median of ``repeats`` timed ones (:func:`host_adam_times`); returns ``numel`` / that
    median.
    """
    times = host_adam_times(numel, repeats, threads=threads, chunk_size=chunk_size,
                            warmup=warmup)
    median = statistics.median(times)
    if not median > 0:
        raise RuntimeError(f"measure_host_adam: timer resolution too coarse for {numel} "
                           "elements (median time 0); measure more elements")
    return numel / median


def host_adam_times(numel: int = 1 << 24, repeats: int = 5, *, threads: int | None = None,
                    chunk_size: int | None = None, warmup: int = 1,
                    seconds: float | None = None) -> list[float]:
    """The seconds of each timed host AdamW call of :func:`measure_host_adam` (same buffers,
    settings and warm-up). ``seconds``: stop early once the timed calls add up to that
    much, after at least ``min(repeats, 3)`` of them (``repeats`` is then the most)."""
    from zenflow_triton import ZenFlowConfig
    from zenflow_triton.host import HostAdamW, HostHyper

    for name, value, lo in (("numel", numel, 1), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"measure_host_adam: {name} must be an int >= {lo}, got {value!r}")
    how = host_adam_settings(threads, chunk_size)
    cfg = ZenFlowConfig()
    divisor = float(cfg.update_interval)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    adamw = HostAdamW(how["threads"], how["chunk_size"], cfg.host_timeout)
    times: list[float] = []
    try:
        for i in range(warmup + repeats):
            hyper = HostHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                              step=i + 1, grad_divisor=divisor)
            t = time.perf_counter()
            adamw.update_many([(master, grad, m, v, hyper)])
            if i >= warmup:
                times.append(time.perf_counter() - t)
            grad.mul_(divisor)  # undo the in-place division (untimed): same gradient each call
            if (seconds is not None and len(times) >= min(repeats, 3)
                    and sum(times) >= seconds):
                break
    finally:
        adamw.close()
    return times
