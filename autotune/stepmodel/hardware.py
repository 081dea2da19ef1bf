"""The hardware facts the model uses: a profile's accelerator FLOP/s and memory bandwidth,
the device-host link's bandwidth per direction, and the host's cores and AdamW rate, read
from a profile and shared among the processes of one node. The host AdamW rate a GPU's
process gets (a measured figure, or the default per core capped by host memory bandwidth)
is worked out here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..detect import usable_cpus
from .base import (DEFAULT_ACCELERATORS_PER_NODE, DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE,
                   DEFAULT_HOST_CORES_PER_ACCELERATOR, HOST_ADAM_BYTES_PER_ELEMENT,
                   HOST_MEMORY_EFFICIENCY, StepModelError)


@dataclass(frozen=True)
class Hardware:
    """The facts the model uses, in SI units (bytes/s, FLOP/s, bytes). ``None`` = unknown.

    ``host_cores`` and ``host_adam_elements_per_s`` describe one node's host (all its cores;
    for the ``cpu`` profile, this machine); ``accelerators_per_node`` of them share it.
    ``sources`` says where each figure came from (profile field, default, measurement)."""

    name: str
    device_flops: float | None                 # dense bf16 tensor FLOP/s
    device_memory_bandwidth: float | None      # B/s
    link_bandwidth: float | None               # B/s, each direction
    device_memory_bytes: float | None = None
    device_flops_fp32: float | None = None
    host_cores: int | None = None
    host_adam_elements_per_s: float | None = None
    accelerators_per_node: int | None = None
    host_memory_bandwidth: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_profile(cls, profile: Any, *, host_adam_elements_per_s: float | None = None,
                     host_cores: int | None = None) -> "Hardware":
        """From a profile name, a :class:`~zenflow_triton.profiles.Profile`, a profile
        document (dict with ``"hardware"``) or a bare ``hardware`` dict. The keyword
        arguments override the profile's host figures (e.g. a measurement on this machine).

        For the ``cpu`` profile the host is this machine: ``host_cores`` defaults to its
        usable CPUs."""
        name, hw = _profile_hardware(profile)
        src: dict[str, str] = {}

        def num(key: str, scale: float) -> float | None:
            v = hw.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                return None
            src[key] = f"profile {name!r}: {key} = {v}"
            return float(v) * scale

        link = num("link_bandwidth_per_direction_gb_s", 1e9)
        if link is None:
            both = num("link_bandwidth_gb_s", 1e9)
            if both is not None:
                link = both / 2
                src["link_bandwidth_per_direction_gb_s"] = (
                    f"profile {name!r}: link_bandwidth_gb_s / 2 (both directions together)")
        cores = host_cores if host_cores is not None else hw.get("host_cores")
        if host_cores is not None:
            src["host_cores"] = f"given: {host_cores}"
        elif isinstance(cores, int) and cores > 0:
            src["host_cores"] = f"profile {name!r}: host_cores = {cores}"
        elif name == "cpu":
            cores = usable_cpus()
            src["host_cores"] = f"this machine's usable CPUs ({cores}; cpu profile)"
        else:
            cores = None
        rate = host_adam_elements_per_s
        if rate is not None:
            src["host_adam_elements_per_s"] = f"given: {rate:.4g}/s"
        else:
            rate = num("host_adam_elements_per_s", 1.0)
        apn = hw.get("accelerators_per_node")
        apn = apn if isinstance(apn, int) and not isinstance(apn, bool) and apn > 0 else None
        if apn is not None:
            src["accelerators_per_node"] = f"profile {name!r}: accelerators_per_node = {apn}"
        mem = num("device_memory_gb", 1e9)
        return cls(name=name, device_flops=num("bf16_tensor_tflops_dense", 1e12),
                   device_memory_bandwidth=num("memory_bandwidth_gb_s", 1e9),
                   link_bandwidth=link, device_memory_bytes=mem,
                   device_flops_fp32=num("fp32_tflops", 1e12), host_cores=cores,
                   host_adam_elements_per_s=rate, accelerators_per_node=apn,
                   host_memory_bandwidth=num("host_memory_bandwidth_gb_s", 1e9), sources=src)

    # -- derived -------------------------------------------------------------------------
    def processes_per_host(self, gpus: int) -> int:
        """Training processes (one per GPU) sharing one host."""
        return max(1, min(gpus, self.accelerators_per_node or DEFAULT_ACCELERATORS_PER_NODE))

    def host_rate(self, gpus: int = 1) -> float:
        """Host AdamW elements/s available to one GPU's process: a node's figure divided
        among the processes that share the node."""
        return self.host_rate_and_source(gpus)[0]

    def host_rate_and_source(self, gpus: int = 1) -> tuple[float, str]:
        g = self.processes_per_host(gpus)
        if self.host_adam_elements_per_s:
            return (self.host_adam_elements_per_s / g,
                    f"{self.host_adam_elements_per_s:.3g}/s per host"
                    + (f" / {g} processes" if g > 1 else "")
                    + f" ({self.sources.get('host_adam_elements_per_s', 'given')})")
        if self.host_cores:
            cores = self.host_cores / g
            how = f"{self.host_cores} host cores" + (f" / {g} processes" if g > 1 else "")
        else:
            cores = DEFAULT_HOST_CORES_PER_ACCELERATOR
            how = f"default {DEFAULT_HOST_CORES_PER_ACCELERATOR} host cores per accelerator"
        rate = cores * DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE
        how += f" x default {DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE:.0e}/s per core"
        if self.host_memory_bandwidth:
            cap = (HOST_MEMORY_EFFICIENCY * self.host_memory_bandwidth / g
                   / HOST_ADAM_BYTES_PER_ELEMENT)
            if cap < rate:
                rate = cap
                how = (f"host memory bound: {HOST_MEMORY_EFFICIENCY:g} x "
                       f"{self.host_memory_bandwidth / 1e9:g} GB/s / {g} / "
                       f"{HOST_ADAM_BYTES_PER_ELEMENT} B")
        return rate, how

    def missing_device_facts(self) -> list[str]:
        out = []
        for attr, key in (("device_flops", "bf16_tensor_tflops_dense"),
                          ("device_memory_bandwidth", "memory_bandwidth_gb_s"),
                          ("link_bandwidth", "link_bandwidth_per_direction_gb_s")):
            if getattr(self, attr) is None:
                out.append(key)
        return out

    def require_device(self) -> None:
        missing = self.missing_device_facts()
        if missing:
            raise StepModelError(
                f"profile {self.name!r} lacks the accelerator facts the step-time model "
                f"needs ({', '.join(missing)}); the cpu profile has no accelerator. Pick a GPU "
                "profile (zenflow-tune list), or use host_update_seconds() for host-side "
                "predictions only")


def _profile_hardware(profile: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(profile, str):
        from zenflow_triton.profiles import load_profile

        prof = load_profile(profile)
        return prof.name, dict(prof.hardware)
    if hasattr(profile, "hardware") and hasattr(profile, "name"):
        return str(profile.name), dict(profile.hardware)
    if isinstance(profile, Mapping):
        if isinstance(profile.get("hardware"), Mapping):
            return str(profile.get("name", "custom")), dict(profile["hardware"])
        return str(profile.get("name", "custom")), dict(profile)
    raise StepModelError(f"expected a profile name, Profile or dict, got {type(profile).__name__}")
