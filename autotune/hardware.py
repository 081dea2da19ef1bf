"""What hardware the tuner sees (``zenflow-tune detect``) and which built-in profile it matches."""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["detect", "matching_builtin", "hardware_slug", "measure_host_adam"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _usable_cpus() -> int:
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
            "usable_cpus": _usable_cpus(),
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
    (r"H200", "h200-sxm"),
    (r"H100.*(PCIe|NVL)", "h100-pcie5"),
    (r"H100", "h100-sxm5"),
    (r"A100.*PCIe", "a100-pcie4"),
    (r"A100", "a100-sxm4"),
    (r"L40S", "l40s-pcie4"),
    (r"4090", "rtx4090-pcie4"),
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
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "device"


def measure_host_adam(numel: int = 1 << 20, repeats: int = 5) -> float:
    """Elements per second of ``torch.optim.AdamW`` on one fp32 CPU tensor (host-Adam speed)."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()  # allocate state
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t)
    return numel / best
