"""What a prediction is made of: the model's names and constants, a profile's hardware facts,
the parameter shapes of a workload (from a named preset or a ``torch.nn.Module``) and the
ZenFlow settings, a validated ``ZenFlowConfig``. Nothing here schedules anything.

* the mode, sharding and lane names, the constants (each written down in
  docs/stepmodel.md, "Constants") and :class:`StepModelError`, the error the model raises
  on bad input;
* :class:`Hardware`: a profile's accelerator FLOP/s and memory bandwidth, the device-host
  link's bandwidth in each direction, alone and while the other direction is busy (measured
  figures where the profile has them, else its datasheet figure), and the host's cores and
  AdamW rate, shared among the processes of one node (the host rate a GPU's process gets is
  worked out here);
* :class:`ParamSpec` (one param's shape, and whether the optimizer splits it by columns)
  and :class:`Layer` (params whose gradients are ready together, with their FLOPs per
  token);
* :data:`PRESETS`: the named architectures (Llama 2 7B and 13B, Qwen2.5 3B, OPT 350M), each
  from its published config, and how one is built into layers;
* :class:`Workload`: what one GPU trains per optimizer step (layers, tokens, dtype, MFU);
* :func:`zenflow_config` (the optimizer's own validation and defaults) and the settings a
  prediction reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from zenflow_triton.config import matches_any

from ..detect import usable_cpus

MODES = ("adamw", "zero-offload", "zero-offload-dpu", "overlapped-offload", "state-swap",
         "zenflow")
SHARDINGS = ("ddp", "fsdp2")
"""How params are laid out over the GPUs: ``ddp`` (each GPU holds the whole model; the
offloaded rows and ``adamw``'s state sharded 1/N) or ``fsdp2`` (``fully_shard``: params,
gradients and every optimizer state sharded 1/N by rows)."""
LANES = ("device", "link-down", "link-up", "host")


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


# ---- shapes: params and layers -----------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        """Columns of the optimizer's 2-D view [shape[0], numel // shape[0]]."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else 0

    def is_matrix(self, min_offload_numel: int, dense_params: tuple[str, ...] = ()) -> bool:
        """Split by columns (else: device-owned, like 1-D params), as zenflow_triton.state.classify decides:
        ``dense_params`` are ZenFlow's dense set (name patterns kept whole on the device)."""
        return (len(self.shape) >= 2 and self.numel >= min_offload_numel
                and not matches_any(self.name, dense_params))


@dataclass(frozen=True)
class Layer:
    """A group of params whose gradients are ready together in backward (a transformer
    block), in forward order, with the model FLOPs per token of its forward+backward."""

    name: str
    params: tuple[ParamSpec, ...]
    flops_per_token: float


# ---- presets: named architectures --------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(
        arch="llama", hidden=4096, layers=32, intermediate=11008, vocab=32000, heads=32,
        kv_heads=32, tied=False,
        source="Llama 2 (Touvron et al. 2023, arXiv 2307.09288); meta-llama/Llama-2-7b-hf "
               "config.json: hidden 4096, 32 layers, intermediate 11008, vocab 32000, 32 heads"),
    "llama2-13b": dict(
        arch="llama", hidden=5120, layers=40, intermediate=13824, vocab=32000, heads=40,
        kv_heads=40, tied=False,
        source="Llama 2 (arXiv 2307.09288); meta-llama/Llama-2-13b-hf config.json: hidden "
               "5120, 40 layers, intermediate 13824, vocab 32000, 40 heads"),
    "qwen2.5-3b": dict(
        arch="llama", hidden=2048, layers=36, intermediate=11008, vocab=151936, heads=16,
        kv_heads=2, tied=True, qkv_bias=True,
        source="Qwen2.5 technical report (arXiv 2412.15115, Table 1); Qwen/Qwen2.5-3B "
               "config.json: hidden 2048, 36 layers, intermediate 11008, vocab 151936, 16 "
               "query / 2 KV heads, tied embeddings, q/k/v biases"),
    "llama3-8b": dict(
        arch="llama", hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32,
        kv_heads=8, tied=False,
        source="Llama 3 (Grattafiori et al. 2024, arXiv 2407.21783, Table 3); "
               "meta-llama/Meta-Llama-3-8B config.json: hidden 4096, 32 layers, intermediate "
               "14336, vocab 128256, 32 query / 8 KV heads, untied head"),
    "llama3-70b": dict(
        arch="llama", hidden=8192, layers=80, intermediate=28672, vocab=128256, heads=64,
        kv_heads=8, tied=False,
        source="Llama 3 (arXiv 2407.21783, Table 3); meta-llama/Meta-Llama-3-70B config.json: "
               "hidden 8192, 80 layers, intermediate 28672, vocab 128256, 64 query / 8 KV heads"),
    "mistral-7b": dict(
        arch="llama", hidden=4096, layers=32, intermediate=14336, vocab=32000, heads=32,
        kv_heads=8, tied=False,
        source="Mistral 7B (Jiang et al. 2023, arXiv 2310.06825, Table 1); "
               "mistralai/Mistral-7B-v0.1 config.json: hidden 4096, 32 layers, intermediate "
               "14336, vocab 32000, 32 query / 8 KV heads, untied head"),
    "qwen2.5-7b": dict(
        arch="llama", hidden=3584, layers=28, intermediate=18944, vocab=152064, heads=28,
        kv_heads=4, tied=False, qkv_bias=True,
        source="Qwen2.5 technical report (arXiv 2412.15115, Table 1); Qwen/Qwen2.5-7B "
               "config.json: hidden 3584, 28 layers, intermediate 18944, vocab 152064, 28 "
               "query / 4 KV heads, untied head, q/k/v biases"),
    "qwen3-0.6b": dict(
        arch="llama", hidden=1024, layers=28, intermediate=3072, vocab=151936, heads=16,
        kv_heads=8, head_dim=128, qk_norm=True, tied=True,
        source="Qwen3 technical report (arXiv 2505.09388, Table 1); Qwen/Qwen3-0.6B "
               "config.json: hidden 1024, 28 layers, intermediate 3072, vocab 151936, 16 "
               "query / 8 KV heads of dim 128, q/k norms, tied embeddings"),
    "qwen3-14b": dict(
        arch="llama", hidden=5120, layers=40, intermediate=17408, vocab=151936, heads=40,
        kv_heads=8, head_dim=128, qk_norm=True, tied=False,
        source="Qwen3 technical report (arXiv 2505.09388, Table 1); Qwen/Qwen3-14B "
               "config.json: hidden 5120, 40 layers, intermediate 17408, vocab 151936, 40 "
               "query / 8 KV heads of dim 128, q/k norms, untied head"),
    "opt-350m": dict(
        arch="opt", hidden=1024, layers=24, intermediate=4096, vocab=50272, heads=16,
        max_positions=2048, embed_dim=512, tied=True,
        source="OPT (Zhang et al. 2022, arXiv 2205.01068); facebook/opt-350m config.json: "
               "hidden 1024, 24 layers, ffn 4096, vocab 50272, 16 heads, word_embed_proj_dim "
               "512 (project_in/out), learned positions 2048+2, post-LN (no final LN), tied"),
}


def _build_preset(a: Mapping[str, Any], seq: int) -> tuple[Layer, ...]:
    d, L, ff, V, H = a["hidden"], a["layers"], a["intermediate"], a["vocab"], a["heads"]
    attn_flops = 12.0 * d * seq  # per layer per token: QK^T and AV, forward + backward
    layers: list[Layer] = []
    if a["arch"] == "llama":
        head_dim = a.get("head_dim", d // H)
        q, kv = H * head_dim, a["kv_heads"] * head_dim
        bias = a.get("qkv_bias", False)
        layers.append(Layer("embed_tokens", (ParamSpec("embed_tokens.weight", (V, d)),), 0.0))
        for i in range(L):
            p = f"layers.{i}."
            ps = [ParamSpec(p + "self_attn.q_proj.weight", (q, d)),
                  ParamSpec(p + "self_attn.k_proj.weight", (kv, d)),
                  ParamSpec(p + "self_attn.v_proj.weight", (kv, d)),
                  ParamSpec(p + "self_attn.o_proj.weight", (d, q)),
                  ParamSpec(p + "mlp.gate_proj.weight", (ff, d)),
                  ParamSpec(p + "mlp.up_proj.weight", (ff, d)),
                  ParamSpec(p + "mlp.down_proj.weight", (d, ff)),
                  ParamSpec(p + "input_layernorm.weight", (d,)),
                  ParamSpec(p + "post_attention_layernorm.weight", (d,))]
            if a.get("qk_norm"):
                ps += [ParamSpec(p + "self_attn.q_norm.weight", (head_dim,)),
                       ParamSpec(p + "self_attn.k_norm.weight", (head_dim,))]
            if bias:
                ps += [ParamSpec(p + "self_attn.q_proj.bias", (q,)),
                       ParamSpec(p + "self_attn.k_proj.bias", (kv,)),
                       ParamSpec(p + "self_attn.v_proj.bias", (kv,))]
            mat = sum(x.numel for x in ps if len(x.shape) == 2)
            layers.append(Layer(f"layers.{i}", tuple(ps), 6.0 * mat + attn_flops))
        head = [ParamSpec("norm.weight", (d,))]
        if not a["tied"]:
            head.append(ParamSpec("lm_head.weight", (V, d)))
        layers.append(Layer("norm+lm_head", tuple(head), 6.0 * V * d))  # tied: FLOPs only
        return tuple(layers)
    if a["arch"] == "opt":
        e = a["embed_dim"]
        layers.append(Layer("embed", (ParamSpec("embed_tokens.weight", (V, e)),
                                      ParamSpec("embed_positions.weight",
                                                (a["max_positions"] + 2, d)),
                                      ParamSpec("project_in.weight", (d, e))), 6.0 * d * e))
        for i in range(L):
            p = f"layers.{i}."
            ps = []
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                ps += [ParamSpec(p + f"self_attn.{proj}.weight", (d, d)),
                       ParamSpec(p + f"self_attn.{proj}.bias", (d,))]
            ps += [ParamSpec(p + "self_attn_layer_norm.weight", (d,)),
                   ParamSpec(p + "self_attn_layer_norm.bias", (d,)),
                   ParamSpec(p + "fc1.weight", (ff, d)), ParamSpec(p + "fc1.bias", (ff,)),
                   ParamSpec(p + "fc2.weight", (d, ff)), ParamSpec(p + "fc2.bias", (d,)),
                   ParamSpec(p + "final_layer_norm.weight", (d,)),
                   ParamSpec(p + "final_layer_norm.bias", (d,))]
            mat = sum(x.numel for x in ps if len(x.shape) == 2)
            layers.append(Layer(f"layers.{i}", tuple(ps), 6.0 * mat + attn_flops))
        layers.append(Layer("project_out+lm_head", (ParamSpec("project_out.weight", (e, d)),),
                            6.0 * (e * d + V * e)))
        return tuple(layers)
    raise StepModelError(f"unknown architecture {a['arch']!r}")  # pragma: no cover


# ---- workload: what one GPU trains per step ----------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What one GPU trains per optimizer step. ``tokens`` is per GPU per optimizer step (the
    compute of a step); ``micro_batch_tokens`` the tokens it holds activations for at once
    (None: the whole step in one pass). A step of ``tokens`` runs ``micro_batches`` forward
    and backward passes (gradient accumulation), the last one shorter where the micro-batch
    does not divide the step."""

    name: str
    layers: tuple[Layer, ...]
    tokens: int = DEFAULT_TOKENS
    dtype: str = "bfloat16"
    mfu: float = DEFAULT_MFU
    source: str = ""
    recompute: bool = True
    """Full activation recompute (checkpointing): what the activation memory assumes
    (``activations.activation_bytes``)."""
    micro_batch_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise StepModelError(f"tokens must be an int >= 1, got {self.tokens!r}")
        m = self.micro_batch_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool)
                              or not 1 <= m <= self.tokens):
            raise StepModelError(f"micro_batch_tokens must be an int in [1, tokens="
                                 f"{self.tokens}], got {m!r}")
        if not (isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1):
            raise StepModelError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.dtype not in DTYPE_BYTES:
            raise StepModelError(f"dtype must be one of {list(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def micro_tokens(self) -> int:
        """Tokens of one forward and backward pass: what the activations are held for."""
        return self.micro_batch_tokens or self.tokens

    @property
    def micro_batches(self) -> int:
        """Forward and backward passes per optimizer step (1: no gradient accumulation)."""
        return -(-self.tokens // self.micro_tokens)

    @property
    def params(self) -> list[ParamSpec]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def flops_per_token(self) -> float:
        return sum(layer.flops_per_token for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def replace(self, **changes: Any) -> "Workload":
        import dataclasses

        return dataclasses.replace(self, **changes)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, *, tokens: int = DEFAULT_TOKENS, mfu: float = DEFAULT_MFU,
                    seq_len: int | None = None, dtype: str = "bfloat16") -> "Workload":
        """A named architecture (:data:`PRESETS`), built from its published numbers."""
        arch = PRESETS.get(name)
        if arch is None:
            raise StepModelError(f"unknown model preset {name!r}; valid presets: "
                                 f"{', '.join(sorted(PRESETS))}")
        seq = min(tokens, seq_len or arch.get("seq_len", DEFAULT_SEQ_LEN))
        layers = _build_preset(arch, seq)
        return cls(name=name, layers=layers, tokens=tokens, dtype=dtype, mfu=mfu,
                   source=arch["source"])

    @classmethod
    def from_spec(cls, spec: str, *, tokens: int = DEFAULT_TOKENS,
                  mfu: float = DEFAULT_MFU) -> "Workload":
        """The user's model, however named: a preset (:data:`PRESETS`); a path to an HF
        ``config.json`` or a folder holding one (the model is built on the meta device with
        ``transformers``: nothing is downloaded, no weights are read); or ``module:function``
        returning a ``torch.nn.Module`` (on the meta device, ideally) or a Workload."""
        import os

        if spec in PRESETS:
            return cls.from_preset(spec, tokens=tokens, mfu=mfu)
        if not os.path.exists(spec) and (spec.endswith(".json") or os.path.sep in spec):
            raise StepModelError(f"no such file or folder: {spec!r} (--model takes a preset, "
                                 "a path to an HF config.json or the folder holding it, or "
                                 "module:function)")
        if os.path.exists(spec):
            return cls.from_hf_config(spec, tokens=tokens, mfu=mfu)
        if ":" in spec and os.path.sep not in spec.split(":", 1)[0]:
            return cls._from_factory(spec, tokens=tokens, mfu=mfu)
        raise StepModelError(
            f"unknown model {spec!r}; valid presets: {', '.join(sorted(PRESETS))}; or a path "
            "to an HF config.json or a folder holding one, or module:function returning a "
            "torch.nn.Module (Workload.from_module in Python)")

    @classmethod
    def from_hf_config(cls, path: str, *, tokens: int = DEFAULT_TOKENS,
                       mfu: float = DEFAULT_MFU) -> "Workload":
        """An HF causal LM's shapes from its ``config.json`` (a file or its folder), built on
        the meta device; attention FLOPs as for the presets (12 x hidden x sequence per layer
        and token, the sequence ``min(tokens, max_position_embeddings, 4096)``)."""
        import json
        import os

        import torch
        try:
            import transformers
        except ImportError as e:
            raise StepModelError("a model from a config.json needs transformers: pip install "
                                 "transformers") from e
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        try:
            with open(file) as f:
                doc = json.load(f)
            config = transformers.AutoConfig.for_model(**doc)
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StepModelError(f"{file}: not an HF causal-LM config.json ({e})") from e
        hidden = getattr(config, "hidden_size", 0) or 0
        layers = getattr(config, "num_hidden_layers", 0) or 0
        seq = min(tokens, getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN,
                  DEFAULT_SEQ_LEN)
        name = doc.get("_name_or_path") or os.path.basename(os.path.dirname(
            os.path.abspath(file))) or config.model_type
        return cls.from_module(model, tokens=tokens, mfu=mfu, dtype="bfloat16", name=name,
                               attention_flops_per_token=12.0 * hidden * seq * layers)

    @classmethod
    def _from_factory(cls, spec: str, *, tokens: int, mfu: float) -> "Workload":
        import importlib

        mod_name, _, fn_name = spec.partition(":")
        try:
            made = getattr(importlib.import_module(mod_name), fn_name)()
        except (ImportError, AttributeError) as e:
            raise StepModelError(f"--model {spec!r}: cannot call {fn_name} of {mod_name} "
                                 f"({e})") from e
        if isinstance(made, Workload):
            return made.replace(tokens=tokens, mfu=mfu)
        return cls.from_module(made, tokens=tokens, mfu=mfu, name=spec)

    @classmethod
    def from_module(cls, module: Any, *, tokens: int = DEFAULT_TOKENS, mfu: float = DEFAULT_MFU,
                    dtype: str | None = None, name: str | None = None,
                    attention_flops_per_token: float = 0.0) -> "Workload":
        """Param shapes of a real ``torch.nn.Module`` (meta-device modules work: only shapes
        are read). Layers: params grouped by the module path up to its first numeric
        component (``model.layers.3``), else by their module, in registration order.
        FLOPs: 6 per element per token for each weight an ``nn.Linear``/``nn.Conv*`` uses
        (twice for a tied one: embedding lookup is free, the tied head is a matmul); 0 for
        an embedding's lookup and for 1-D params; other >= 2-D params count as matmuls.
        ``attention_flops_per_token`` (whole model) is spread evenly over the layers."""
        import torch

        matmul_types = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
        lookup_types = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        groups: dict[str, list[ParamSpec]] = {}
        flops: dict[str, float] = {}
        seen: set[int] = set()
        first_dtype = None
        for mod_name, mod in module.named_modules():
            direct = list(mod.named_parameters(recurse=False, remove_duplicate=False))
            if not direct:
                continue
            key = _group_key(mod_name)
            for pname, p in direct:
                if first_dtype is None and p.is_floating_point():
                    first_dtype = p.dtype
                if isinstance(mod, matmul_types) and pname == "weight":
                    per_tok = 6.0 * p.numel()
                elif isinstance(mod, lookup_types) or p.dim() < 2:
                    per_tok = 0.0
                else:
                    per_tok = 6.0 * p.numel()
                groups.setdefault(key, [])
                flops[key] = flops.get(key, 0.0) + per_tok
                if id(p) in seen:  # tied: counted once, its extra use adds FLOPs only
                    continue
                seen.add(id(p))
                full = f"{mod_name}.{pname}" if mod_name else pname
                groups[key].append(ParamSpec(full, tuple(int(s) for s in p.shape)))
        if not groups:
            raise StepModelError("the module has no parameters")
        n = len(groups)
        layers = tuple(Layer(k, tuple(v), flops[k] + attention_flops_per_token / n)
                       for k, v in groups.items())
        if dtype is None:
            dtype = {torch.float32: "float32", torch.float16: "float16"}.get(first_dtype,
                                                                              "bfloat16")
        return cls(name=name or type(module).__name__, layers=layers, tokens=tokens,
                   dtype=dtype, mfu=mfu, source="nn.Module shapes")


def _group_key(mod_name: str) -> str:
    parts = mod_name.split(".") if mod_name else ["(root)"]
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts)


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
