"""What a prediction is made of: the model's names and constants, a profile's hardware facts
and the ZenFlow settings, a validated ``ZenFlowConfig``. Nothing here schedules anything.

* the mode, sharding and lane names, the constants (each written down in
  docs/stepmodel.md, "Constants") and :class:`StepModelError`, the error the model raises
  on bad input;
* :class:`Hardware`: a profile's accelerator FLOP/s and memory bandwidth, the device-host
  link's bandwidth in each direction, alone and while the other direction is busy (measured
  figures where the profile has them, else its datasheet figure), and the host's cores and
  AdamW rate, shared among the processes of one node (the host rate a GPU's process gets is
  worked out here);
* the workload's shapes, presets and tokens live in ``workload.py``;
* :func:`zenflow_config` (the optimizer's own validation and defaults) and the settings a
  prediction reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..detect import usable_cpus

MODES = ("adamw", "zero-offload", "zero-offload-dpu", "overlapped-offload", "state-swap",
         "zenflow")
SHARDINGS = ("ddp", "fsdp2")
"""How params are laid out over the GPUs: ``ddp`` (each GPU holds the whole model; the
offloaded rows and ``adamw``'s state sharded 1/N) or ``fsdp2`` (``fully_shard``: params,
gradients and every optimizer state sharded 1/N by rows)."""
LANES = ("device", "link-down", "link-up", "host")
LOSSES = ("logits", "chunked")
"""How the loss is computed, for the activation memory it needs: ``logits`` (the fp32 logits
of every token, as an HF causal LM's forward computes them) or ``chunked`` (a chunked
cross-entropy that never holds them whole: torch's ``F.linear_cross_entropy`` with
``options``, ``zenflow_triton.loss.causal_lm_loss``); ``activations.activation_bytes``."""


# ---- constants (docs/stepmodel.md, "Constants") --------------------------------------------
DEFAULT_MFU = 0.40
"""Model FLOP utilisation (PaLM's definition: model FLOPs, no recomputation, over peak)."""
DEFAULT_TOKENS = 4096
"""Tokens per GPU per optimizer step (e.g. 2 sequences of 2048)."""
DEVICE_HEADROOM = 0.1
"""The share of device memory a fit leaves free: the CUDA context, the caching allocator's
fragmentation, the framework's own buffers (a fit is never 39.6 GB of 40)."""
DEFAULT_SEQ_LEN = 2048
"""Sequence length of the presets (for the attention FLOPs); capped at the tokens."""
DEFAULT_HOST_CORES_PER_ACCELERATOR = 16
"""Host cores per accelerator when a profile does not say (a 2-socket host of 128 cores for
8 GPUs, as in NVIDIA's DGX A100; 112 for 8 in the DGX H100)."""
DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE = 1.0e8
"""Host AdamW elements/s per core when a profile has no measured figure: host AdamW is memory
bound (28 B per element), and current 2-socket servers sustain about 2.5-4 GB/s of memory
bandwidth per core when every core streams (e.g. 16 channels of DDR4-3200, 409.6 GB/s peak,
~75% sustained, over 128 cores = 2.4 GB/s), i.e. 0.9-1.4e8 elements/s per core."""
DEFAULT_ACCELERATORS_PER_NODE = 8
"""Accelerators sharing one host when a profile does not say (an HGX/DGX node)."""
HOST_MEMORY_EFFICIENCY = 0.8
"""Sustained fraction of a host's peak memory bandwidth (STREAM-like), used only to cap the
default host AdamW rate of a profile that states its host memory bandwidth."""
HOST_ADAM_BYTES_PER_ELEMENT = 28
"""fp32 AdamW on the host: reads master, grad, m, v and writes master, m, v (docs/host.md)."""
DEVICE_ADAMW_BYTES_PER_ELEMENT = 28
"""Fused mixed-precision AdamW on the device per element: bf16 grad read (2), fp32 master,
m and v read and written (24), bf16 param written (2); an fp32 param is its own master (28)."""
STATE_SWAP_CHUNK_ELEMENTS = 1 << 26
"""State-swap streams the Adam state in chunks of at most this many elements (0.8 GB of fp32
master, m and v), through two device buffers: one chunk's copy overlaps another's update.
The chunk size changes the buffers' memory and the pipeline's fill, not the steady rate."""
INDEX_BYTES = 8
"""int64 column indices (device_idx / host_idx) of a split matrix."""
SCRATCH_BYTES_PER_THREAD = 2 * 1024 * 1024
"""Each host AdamW worker's pinned scratch (STREAM_PIECE = 2^19 fp32 elements)."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of each param, accumulator and host state dtype."""


class StepModelError(ValueError):
    """A bad input to the step-time model: an unknown preset, a profile without the facts
    the model needs, an out-of-range setting."""


# ---- hardware: a profile's facts ---------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """The facts the model uses, in SI units (bytes/s, FLOP/s, bytes). ``None`` = unknown.

    ``host_cores`` and ``host_adam_elements_per_s`` describe one node's host (all its cores;
    for the ``cpu`` profile, this machine); ``accelerators_per_node`` of them share it.
    ``sources`` says where each figure came from (profile field, default, measurement)."""

    name: str
    device_flops: float | None                 # dense bf16 tensor FLOP/s
    device_memory_bandwidth: float | None      # B/s
    link_bandwidth: float | None               # B/s, each direction (datasheet)
    device_memory_bytes: float | None = None
    device_flops_fp32: float | None = None
    host_memory_bytes: float | None = None
    """The host's memory, shared by the node's GPU processes; None: unknown, not checked."""
    host_cores: int | None = None
    host_adam_elements_per_s: float | None = None
    accelerators_per_node: int | None = None
    host_memory_bandwidth: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    link_h2d: float | None = None
    """B/s host to device (the ``link-up`` lane) alone; None: ``link_bandwidth``."""
    link_d2h: float | None = None
    """B/s device to host (``link-down``) alone; None: ``link_bandwidth``."""
    link_h2d_while_d2h: float | None = None
    """B/s host to device while device to host is busy; None: no contention (``h2d``)."""
    link_d2h_while_h2d: float | None = None
    """B/s device to host while host to device is busy; None: no contention (``d2h``)."""

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
        directed = {key: num(key, 1e9) for key in LINK_FIELDS}
        if link is None and directed["link_h2d_gb_s"] and directed["link_d2h_gb_s"]:
            link = min(directed["link_h2d_gb_s"], directed["link_d2h_gb_s"])
            src["link_bandwidth_per_direction_gb_s"] = (
                f"profile {name!r}: the slower of link_h2d_gb_s and link_d2h_gb_s (no "
                "datasheet figure)")
        if link is not None:
            _link_fallbacks(name, link, directed, src)
        cores = _host_cores(name, hw, host_cores, src)
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
                   host_memory_bandwidth=num("host_memory_bandwidth_gb_s", 1e9),
                   host_memory_bytes=num("host_memory_gb", 1e9), sources=src,
                   **{attr: directed[key] for key, attr in LINK_FIELDS.items()})

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

    # -- the link, per direction -------------------------------------------------------------
    @property
    def h2d(self) -> float | None:
        """B/s host to device (the ``link-up`` lane) with the other direction idle."""
        return self.link_h2d or self.link_bandwidth

    @property
    def d2h(self) -> float | None:
        """B/s device to host (the ``link-down`` lane) with the other direction idle."""
        return self.link_d2h or self.link_bandwidth

    @property
    def h2d_while_d2h(self) -> float | None:
        """B/s host to device while device to host is busy (at most :attr:`h2d`)."""
        return _at_most(self.link_h2d_while_d2h, self.h2d)

    @property
    def d2h_while_h2d(self) -> float | None:
        """B/s device to host while host to device is busy (at most :attr:`d2h`)."""
        return _at_most(self.link_d2h_while_h2d, self.d2h)

    def link_contention(self) -> dict[str, float]:
        """Per link lane, the share of its rate a transfer keeps while the other direction is
        busy: contended / alone, in (0, 1]; 1 = no contention (every profile without the
        contended figures)."""
        if not (self.h2d and self.d2h):
            return {"link-up": 1.0, "link-down": 1.0}
        return {"link-up": self.h2d_while_d2h / self.h2d,
                "link-down": self.d2h_while_h2d / self.d2h}

    def link_summary(self) -> str:
        """One line: the four link figures the model uses, GB/s (for reports)."""
        if not (self.h2d and self.d2h):
            return "no link figures"
        out = f"{self.h2d / 1e9:g} GB/s to the device, {self.d2h / 1e9:g} to the host"
        if self.link_contention() == {"link-up": 1.0, "link-down": 1.0}:
            return out + ", the same while both run (no contention)"
        return (out + f"; while both run {self.h2d_while_d2h / 1e9:g} to the device and "
                f"{self.d2h_while_h2d / 1e9:g} to the host")

    def with_link(self, bandwidth: float) -> "Hardware":
        """A copy with a symmetric, uncontended link of ``bandwidth`` B/s each direction (the
        measured figures dropped): for what-if scans over the link speed."""
        import dataclasses

        return dataclasses.replace(self, link_bandwidth=bandwidth,
                                   **{attr: None for attr in LINK_FIELDS.values()})

    def missing_device_facts(self) -> list[str]:
        out = []
        for value, key in ((self.device_flops, "bf16_tensor_tflops_dense"),
                           (self.device_memory_bandwidth, "memory_bandwidth_gb_s"),
                           (self.h2d and self.d2h, "link_bandwidth_per_direction_gb_s")):
            if value is None:
                out.append(key)
        return out

    @property
    def usable_host_bytes(self) -> float | None:
        """What a fit may fill of the host's memory, less :data:`DEVICE_HEADROOM`."""
        if self.host_memory_bytes is None:
            return None
        return self.host_memory_bytes * (1.0 - DEVICE_HEADROOM)

    @property
    def usable_device_bytes(self) -> float | None:
        """What a fit may fill: the device memory less :data:`DEVICE_HEADROOM`."""
        if self.device_memory_bytes is None:
            return None
        return self.device_memory_bytes * (1.0 - DEVICE_HEADROOM)

    def require_device(self) -> None:
        missing = self.missing_device_facts()
        if missing:
            raise StepModelError(
                f"profile {self.name!r} lacks the accelerator facts the step-time model "
                f"needs ({', '.join(missing)}); the cpu profile has no accelerator. Pick a GPU "
                "profile (zenflow-tune list), or use host_update_seconds() for host-side "
                "predictions only")


LINK_FIELDS = {"link_h2d_gb_s": "link_h2d", "link_d2h_gb_s": "link_d2h",
               "link_h2d_while_d2h_gb_s": "link_h2d_while_d2h",
               "link_d2h_while_h2d_gb_s": "link_d2h_while_h2d"}
"""The measured link figures a profile's ``hardware`` may give (GB/s, each optional; a
profile without them has the datasheet's ``link_bandwidth_per_direction_gb_s`` both ways and
no contention) and the :class:`Hardware` attribute (B/s) each one fills."""


def _host_cores(name: str, hw: Mapping[str, Any], given: int | None,
                src: dict[str, str]) -> int | None:
    """The host cores: given, the profile's, or (``cpu`` profile) this machine's usable
    CPUs; where each came from goes into ``src``."""
    cores = given if given is not None else hw.get("host_cores")
    if given is not None:
        src["host_cores"] = f"given: {given}"
    elif isinstance(cores, int) and cores > 0:
        src["host_cores"] = f"profile {name!r}: host_cores = {cores}"
    elif name == "cpu":
        cores = usable_cpus()
        src["host_cores"] = f"this machine's usable CPUs ({cores}; cpu profile)"
    else:
        cores = None
    return cores


def _link_fallbacks(name: str, link: float, directed: Mapping[str, float | None],
                    src: dict[str, str]) -> None:
    """The source of each link figure a profile does not give: the datasheet figure for a
    direction alone, that direction's uncontended figure (no contention) while both run."""
    for key, value in directed.items():
        if value is not None:
            continue
        if "_while_" in key:
            alone = key.split("_while_")[0] + "_gb_s"
            src[key] = (f"profile {name!r} has no {key}: {alone}'s figure (no contention "
                        "assumed)")
        else:
            src[key] = (f"profile {name!r} has no {key}: the datasheet figure, "
                        f"{link / 1e9:g} GB/s per direction")


def _at_most(value: float | None, cap: float | None) -> float | None:
    """A contended figure, no faster than the uncontended one (a measurement's noise can put
    it above: the other direction being busy never speeds a copy up); None: ``cap``."""
    if value is None or cap is None:
        return cap
    return min(value, cap)


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


# ---- settings: the ZenFlow configuration -------------------------------------------------
def zenflow_config(config: Any = None, **overrides: Any):
    """A validated ZenFlowConfig (the optimizer's own validation and defaults)."""
    from zenflow_triton.config import ConfigError, ZenFlowConfig

    try:
        if config is None:
            cfg = ZenFlowConfig()
        elif isinstance(config, Mapping):
            cfg = ZenFlowConfig.from_dict(dict(config))
        else:
            cfg = config
        return cfg.replace(**overrides) if overrides else cfg
    except ConfigError as e:
        raise StepModelError(str(e)) from None


SETTING_KEYS = ("topk_ratio", "update_interval", "select_interval", "overlap", "apply_delay",
                "accumulate_on", "accumulator_dtype", "host_state_dtype", "min_offload_numel",
                "host_threads", "dense_params", "stream_grads")
"""The ZenFlow settings a zenflow prediction reports (``Prediction.settings``)."""
