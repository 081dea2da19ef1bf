"""A step-time model of offloaded AdamW training, per hardware profile (``zenflow-tune predict``).

Pure arithmetic over a hardware profile's facts and a workload's parameter shapes: for each
mode it lays out one steady-state window of ``update_interval`` training steps on four
lanes (``device`` compute, ``link-down`` device->host, ``link-up`` host->device, ``host``
compute) and reports the step time, the accelerator's idle (stall) fraction, the bytes that
cross the link, the host's busy fraction and the memory each side needs. Nothing is
measured here (except the host AdamW rate, on request); these are predictions. Every
formula, constant and assumption is written down in ``docs/stepmodel.md``; the short form:

* compute per step = model FLOPs / (MFU x peak bf16 FLOP/s), model FLOPs = 6 x (matmul
  weight elements) x tokens + attention (PaLM's definition); forward 1/3, backward 2/3;
* device optimizer work is memory bound: bytes moved / device memory bandwidth;
* a link transfer takes bytes / (link bandwidth per direction); each direction is a FIFO
  lane of its own;
* host AdamW takes elements / (host AdamW elements/s per process); the host is one FIFO
  lane per process;
* data parallelism over N GPUs: every GPU runs the full model on its own tokens; the
  offloaded (host-owned) elements are sharded by rows, so each GPU moves and each host
  process updates 1/N of them, and the processes on one node share its host; gradient
  all-reduce and the all-gather of updated rows go over the peer links and are not modelled.

Each mode is a small dependency graph (which transfer waits for which compute), scheduled
by :class:`_Lanes` for several windows until it repeats; the last window is the result. So
a case where one lane is the bottleneck gives exactly that lane's work per window, and the
graph for each mode is short enough to check by hand (the tests do).

The model lives in ``autotune/`` rather than ``zenflow_triton/``: it is a planning tool for
the tuner and the CLI, never used by the optimizer at run time, and it knows the optimizer
only through :class:`~zenflow_triton.config.ZenFlowConfig` and the profiles' public loader.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .hardware import usable_cpus

__all__ = [
    "MODES", "LANES", "PRESETS", "StepModelError", "Hardware", "ParamSpec", "Layer",
    "Workload", "Segment", "Prediction", "predict", "predict_all", "host_update_seconds",
    "plot_timelines", "markdown_table", "calibration", "calibration_table", "zenflow_config",
    "DEFAULT_MFU", "DEFAULT_TOKENS", "DEFAULT_SEQ_LEN",
    "DEFAULT_HOST_CORES_PER_ACCELERATOR", "DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE",
]

MODES = ("adamw", "zero-offload", "zero-offload-dpu", "overlapped-offload", "zenflow")
LANES = ("device", "link-down", "link-up", "host")

# ---- constants (docs/stepmodel.md, "Constants") --------------------------------------------
DEFAULT_MFU = 0.40
"""Model FLOP utilisation (PaLM's definition: model FLOPs, no recomputation, over peak)."""
DEFAULT_TOKENS = 4096
"""Tokens per GPU per optimizer step (e.g. 2 sequences of 2048)."""
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
INDEX_BYTES = 8
"""int64 column indices (device_idx / host_idx) of a split matrix."""
SCRATCH_BYTES_PER_THREAD = 2 * 1024 * 1024
"""Each host AdamW worker's pinned scratch (STREAM_PIECE = 2^19 fp32 elements)."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class StepModelError(ValueError):
    """A bad input to the step-time model: an unknown preset, a profile without the facts
    the model needs, an out-of-range setting."""


# ---- hardware --------------------------------------------------------------------------------
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


# ---- workload --------------------------------------------------------------------------------
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

    def is_matrix(self, min_offload_numel: int) -> bool:
        """Split by columns (else: device-owned, like 1-D params), as partition.py decides."""
        return len(self.shape) >= 2 and self.numel >= min_offload_numel


@dataclass(frozen=True)
class Layer:
    """A group of params whose gradients are ready together in backward (a transformer
    block), in forward order, with the model FLOPs per token of its forward+backward."""

    name: str
    params: tuple[ParamSpec, ...]
    flops_per_token: float


@dataclass(frozen=True)
class Workload:
    """What one GPU trains per optimizer step. ``tokens`` is per GPU per step."""

    name: str
    layers: tuple[Layer, ...]
    tokens: int = DEFAULT_TOKENS
    dtype: str = "bfloat16"
    mfu: float = DEFAULT_MFU
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or self.tokens < 1:
            raise StepModelError(f"tokens must be an int >= 1, got {self.tokens!r}")
        if not (isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1):
            raise StepModelError(f"mfu must be in (0, 1], got {self.mfu!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise StepModelError(f"dtype must be one of {list(_DTYPE_BYTES)}, got {self.dtype!r}")

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
        return _DTYPE_BYTES[self.dtype]

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
        head_dim = d // H
        kv = a["kv_heads"] * head_dim
        bias = a.get("qkv_bias", False)
        layers.append(Layer("embed_tokens", (ParamSpec("embed_tokens.weight", (V, d)),), 0.0))
        for i in range(L):
            p = f"layers.{i}."
            ps = [ParamSpec(p + "self_attn.q_proj.weight", (d, d)),
                  ParamSpec(p + "self_attn.k_proj.weight", (kv, d)),
                  ParamSpec(p + "self_attn.v_proj.weight", (kv, d)),
                  ParamSpec(p + "self_attn.o_proj.weight", (d, d)),
                  ParamSpec(p + "mlp.gate_proj.weight", (ff, d)),
                  ParamSpec(p + "mlp.up_proj.weight", (ff, d)),
                  ParamSpec(p + "mlp.down_proj.weight", (d, ff)),
                  ParamSpec(p + "input_layernorm.weight", (d,)),
                  ParamSpec(p + "post_attention_layernorm.weight", (d,))]
            if bias:
                ps += [ParamSpec(p + "self_attn.q_proj.bias", (d,)),
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


# ---- settings ---------------------------------------------------------------------------------
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


_SETTING_KEYS = ("topk_ratio", "update_interval", "select_interval", "overlap", "accumulate_on",
                 "accumulator_dtype", "host_state_dtype", "min_offload_numel", "host_threads")


# ---- the timeline -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    lane: str
    start: float
    end: float
    label: str

    @property
    def duration(self) -> float:
        return self.end - self.start


class _Lanes:
    """Four FIFO lanes. ``run`` starts a task when its lane is free and everything in
    ``after`` has ended; a zero-length task still moves its lane to that time (a stream
    waiting for an event)."""

    def __init__(self) -> None:
        self.free = {lane: 0.0 for lane in LANES}
        self.segments: list[Segment] = []
        self.marks: dict[Any, float] = {}  # the builder's own event times (its state)
        self.cycle = 1

    def relative_state(self, t0: float) -> tuple[float, ...]:
        """Every time that can still delay a later task, relative to ``t0`` (earlier ones
        cannot: every later task starts after a device event at or after ``t0``)."""
        times = [self.free[lane] for lane in LANES] + [self.marks[k] for k in sorted(
            self.marks, key=repr)]
        return tuple(max(0.0, t - t0) for t in times)

    def run(self, lane: str, duration: float, label: str, after: Iterable[float] = ()) -> float:
        start = max(self.free[lane], *after) if after else self.free[lane]
        end = start + duration
        if duration > 0:
            self.segments.append(Segment(lane, start, end, label))
        self.free[lane] = end
        return end


@dataclass
class Prediction:
    """One mode's steady-state window. Times in seconds, bytes per GPU. ``step_time_s`` etc.
    are ``None`` when the mode does not fit in device memory (``fits`` False);
    ``modelled_step_time_s`` is then what it would take with memory to spare."""

    mode: str
    step_time_s: float | None
    stall_fraction: float | None
    link_bytes_per_step: float
    link_down_bytes_per_step: float
    link_up_bytes_per_step: float
    host_busy_fraction: float | None
    device_memory_bytes: int
    host_memory_bytes: int
    fits: bool
    modelled_step_time_s: float
    window_steps: int
    window_time_s: float
    timeline: list[Segment]
    memory: dict[str, dict[str, float]]
    settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of ``zenflow-tune predict --json``."""
        out: dict[str, Any] = {
            "step_time_s": self.step_time_s,
            "stall_fraction": self.stall_fraction,
            "link_bytes_per_step": int(round(self.link_bytes_per_step)),
            "host_busy_fraction": self.host_busy_fraction,
            "device_memory_bytes": self.device_memory_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "fits": self.fits,
        }
        if self.settings is not None:
            out["settings"] = dict(self.settings)
        return out


@dataclass(frozen=True)
class _Costs:
    """Every duration (s) and element count one GPU's process sees."""

    n_gpus: int
    fwd: tuple[float, ...]          # per layer, forward order
    bwd: tuple[float, ...]
    matrix: tuple[float, ...]       # per layer: offloadable elements (all ranks)
    small: float                    # device-owned small params' elements
    total: float
    b: int                          # param (and grad) bytes
    Bm: float
    BL: float
    R: float                        # host AdamW elements/s for this process


def _costs(hw: Hardware, wl: Workload, gpus: int, min_offload_numel: int) -> _Costs:
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
        m = sum(p.numel for p in layer.params if p.is_matrix(min_offload_numel))
        matrix.append(float(m))
        small += sum(p.numel for p in layer.params if not p.is_matrix(min_offload_numel))
    return _Costs(gpus, tuple(fwd), tuple(bwd), tuple(matrix), float(small), float(wl.numel),
                  wl.param_bytes, hw.device_memory_bandwidth, hw.link_bandwidth,
                  hw.host_rate(gpus))


def _k(topk_ratio: float, cols: int) -> int:
    """Device-owned columns of a matrix, as the optimizer rounds them (partition.py)."""
    if topk_ratio <= 0:
        return 0
    return min(cols, max(1, round(topk_ratio * cols)))


# ---- memory (the optimizer's byte accounting, README "Memory") --------------------------------
def _memory(mode: str, wl: Workload, c: _Costs, cfg: Any, threads: int) -> dict[str, dict]:
    b, n = c.b, c.n_gpus
    master = 12 if b < 4 else 8            # fp32 master (a bf16 param needs one), m, v
    dev: dict[str, float] = {"params": c.total * b, "grads": c.total * b}
    host: dict[str, float] = {}
    P = sum(c.matrix)
    s = _DTYPE_BYTES[cfg.host_state_dtype]
    scratch = threads * SCRATCH_BYTES_PER_THREAD
    moment_scratch = 2 * scratch if s < 4 else 0
    if mode == "adamw":
        dev["optimizer state (sharded 1/N)"] = c.total * master / n
    else:
        dev["small params' AdamW state"] = c.small * master
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
            if not p.is_matrix(cfg.min_offload_numel):
                continue
            k = _k(cfg.topk_ratio, p.cols)
            rows = p.shape[0]
            e_dev += rows * k
            e_host += rows * (p.cols - k)
            if k > 0:
                idx += p.cols * INDEX_BYTES
        a = _DTYPE_BYTES[cfg.accumulator_dtype]
        dev["device-owned columns' AdamW state"] = e_dev * master
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


# ---- the modes --------------------------------------------------------------------------------
_MAX_WINDOWS = 5000


def _run_windows(body, K: int, lanes: _Lanes | None = None) -> tuple[_Lanes, list[float]]:
    """Call ``body(lanes, w, i)`` (which schedules step ``i`` of window ``w`` and returns
    the start of its first forward) window after window until the schedule repeats: the
    state at the end of a window (every lane's free time and every time the builder keeps
    in ``lanes.marks``, relative to the window's start) equals the state ``c`` windows
    earlier, so every later window repeats those ``c``. Returns the lanes (``lanes.cycle``
    = c) and the start of every window, the last one being the window after the cycle."""
    lanes = lanes or _Lanes()
    starts: list[float] = []
    states: list[tuple[float, ...]] = []
    for w in range(_MAX_WINDOWS):
        for i in range(K):
            t = body(lanes, w, i)
            if i == 0:
                starts.append(t)
        states.append(lanes.relative_state(starts[-1]))
        c = _cycle(states)
        if c:
            lanes.cycle = c
            break
    else:  # pragma: no cover - never seen; the mean of the last windows is then reported
        lanes.cycle = 8
    starts.append(body(lanes, len(starts), 0))
    return lanes, starts


def _cycle(states: list[tuple[float, ...]], tol: float = 1e-9) -> int:
    """The period c (in windows) once the last state equals the one c windows before."""
    last = states[-1]
    scale = max(max(last, default=0.0), 1e-30)
    for c in (1, 2, 3, 4):
        if len(states) > c and all(abs(a - b) <= tol * scale
                                   for a, b in zip(last, states[-1 - c])):
            return c
    return 0


def _window(lanes: _Lanes, starts: list[float]) -> tuple[float, list[Segment], dict]:
    """The last window's segments (clipped, relative to its start), the mean window length
    over the repeating cycle, and each lane's busy time per window over that cycle."""
    c = lanes.cycle
    t0, t1 = starts[-2], starts[-1]
    lo_c, hi_c = starts[-1 - c], starts[-1]
    segs = [Segment(s.lane, max(s.start, t0) - t0, min(s.end, t1) - t0, s.label)
            for s in lanes.segments if s.end > t0 and s.start < t1]
    busy = {lane: 0.0 for lane in LANES}
    for s in lanes.segments:
        lo, hi = max(s.start, lo_c), min(s.end, hi_c)
        if hi > lo:
            busy[s.lane] += (hi - lo) / c
    return (hi_c - lo_c) / c, segs, busy


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
    return c.small * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm


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
    (overlap=False), or at the next boundary (overlap=True; the up copy is issued there, at
    the apply point, unless ``prefetch_result``)."""
    n = c.n_gpus
    g = b = c.b
    a = _DTYPE_BYTES[cfg.accumulator_dtype]
    e_dev = e_host = 0.0
    for p in wl.params:
        if p.is_matrix(cfg.min_offload_numel):
            k = _k(cfg.topk_ratio, p.cols)
            e_dev += p.shape[0] * k
            e_host += p.shape[0] * (p.cols - k)
    h = e_host / n                                  # this rank's host-owned elements
    F, B = sum(c.fwd), sum(c.bwd)
    windowed = K > 1 and h > 0
    on_host = windowed and cfg.accumulate_on == "host"
    selects = 0 < cfg.topk_ratio < 1
    dev_update = (c.small + e_dev) * DEVICE_ADAMW_BYTES_PER_ELEMENT / c.Bm
    score = (sum(c.matrix) * g / c.Bm / cfg.effective_select_interval) if selects else 0.0
    acc = h * (g + 2 * a) / c.Bm if windowed and not on_host else 0.0
    gather = h * 2 * g / c.Bm if on_host else 0.0
    mean = h * (a + b) / c.Bm if windowed and not on_host else 0.0
    scatter = e_host * 2 * b / c.Bm if cfg.topk_ratio > 0 and h > 0 else 0.0
    down_window = h * (b if windowed else g) / c.BL if not on_host else 0.0
    down_step = h * g / c.BL if on_host else 0.0
    host_add = h * (g + 2 * a) / HOST_ADAM_BYTES_PER_ELEMENT / c.R if on_host else 0.0
    host_adam = h / c.R
    up = h * b / c.BL
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
        if i != K - 1 or h == 0:
            return start
        # window boundary
        if cfg.overlap and "job_host_end" in state:  # drain the previous window
            after = [state["job_host_end"]] + ([] if prefetch_result else [t])
            u = L.run("link-up", up, "params up", after)
            t = L.run("device", scatter, "apply (scatter)", [u])
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
        window_dev = K * (F + B + dev_update + score + acc + gather) + mean + scatter
        drain = ((max(0.0, job - (F + B)) - max(0.0, job - window_dev))
                 / cfg.effective_select_interval)
    return lanes_starts, drain, {"device_owned_elements": e_dev, "host_owned_elements": e_host,
                                 "link_down_per_window": (h * (b if windowed else g)
                                                          if not on_host else K * h * g),
                                 "link_up_per_window": h * b}


def predict(hw: Hardware, wl: Workload, mode: str, *, gpus: int = 1, config: Any = None,
            window_steps: int | None = None, prefetch_result: bool = False,
            **settings: Any) -> Prediction:
    """Predict one mode's steady-state window (``window_steps`` steps, default the zenflow
    ``update_interval``). ``config`` (a ZenFlowConfig or dict) and ``settings`` (its fields,
    e.g. ``topk_ratio=0.1, update_interval=4, overlap=True, accumulate_on="device"``) are the
    ZenFlow settings; the other modes use only ``min_offload_numel``, ``host_state_dtype``
    and ``host_threads`` from them (which params stay on the device, host state bytes,
    scratch)."""
    if mode not in MODES:
        raise StepModelError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise StepModelError(f"gpus must be an int >= 1, got {gpus!r}")
    cfg = zenflow_config(config, **settings)
    K = window_steps or cfg.update_interval
    c = _costs(hw, wl, gpus, cfg.min_offload_numel)
    procs = hw.processes_per_host(gpus)
    threads = cfg.host_threads or (max(1, hw.host_cores // procs) if hw.host_cores
                                   else DEFAULT_HOST_CORES_PER_ACCELERATOR)
    P = sum(c.matrix) / gpus
    extra = 0.0
    notes: list[str] = []
    out_settings = None
    if mode == "adamw":
        (lanes, starts), down_b, up_b = _adamw(c, K), 0.0, 0.0
        if gpus > 1:
            notes.append("optimizer state sharded over the GPUs (ZeRO-1/2); its all-gather "
                         "is not modelled")
    elif mode == "zero-offload":
        (lanes, starts), down_b, up_b = _zero_offload(c, K), P * c.b, P * c.b
    elif mode == "zero-offload-dpu":
        (lanes, starts), down_b, up_b = _zero_offload_dpu(c, K), P * c.b, P * c.b
    elif mode == "overlapped-offload":
        (lanes, starts), down_b, up_b = _overlapped_offload(c, K), P * c.b, P * c.b
    else:
        K = cfg.update_interval
        (lanes, starts), extra, info = _zenflow(c, K, wl, cfg, prefetch_result)
        down_b = info["link_down_per_window"] / K
        up_b = info["link_up_per_window"] / K
        out_settings = {k: getattr(cfg, k) for k in _SETTING_KEYS}
        out_settings["select_interval"] = cfg.effective_select_interval
        out_settings["prefetch_result"] = prefetch_result
        if extra:
            notes.append(f"a reselection every {cfg.effective_select_interval} steps drains "
                         f"the host job: +{extra * 1e3:.3g} ms per step, amortised")
    window, segs, busy = _window(lanes, starts)
    busy_dev, busy_host = busy["device"], busy["host"]
    step = window / K + extra
    stall = (window - busy_dev + K * extra) / (K * step) if step > 0 else 0.0
    host_busy = busy_host / (K * step) if step > 0 else 0.0
    mem = _memory(mode, wl, c, cfg, threads)
    dev_bytes = int(round(sum(mem["device"].values())))
    host_bytes = int(round(sum(mem["host"].values())))
    fits = hw.device_memory_bytes is None or dev_bytes <= hw.device_memory_bytes
    if not fits:
        notes.append(f"does not fit: needs {dev_bytes / 1e9:.1f} GB of device memory, the "
                     f"device has {hw.device_memory_bytes / 1e9:.0f} GB")
    return Prediction(
        mode=mode, step_time_s=step if fits else None,
        stall_fraction=max(0.0, stall) if fits else None,
        link_bytes_per_step=down_b + up_b, link_down_bytes_per_step=down_b,
        link_up_bytes_per_step=up_b, host_busy_fraction=host_busy if fits else None,
        device_memory_bytes=dev_bytes, host_memory_bytes=host_bytes, fits=fits,
        modelled_step_time_s=step, window_steps=K, window_time_s=window, timeline=segs,
        memory=mem, settings=out_settings, notes=notes)


def predict_all(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                modes: Sequence[str] = MODES, **settings: Any) -> dict[str, Prediction]:
    """:func:`predict` for every mode, windows of the zenflow ``update_interval`` steps."""
    cfg = zenflow_config(config, **settings)
    return {m: predict(hw, wl, m, gpus=gpus, config=cfg) for m in modes}


def host_update_seconds(hw: Hardware, wl: Workload, *, gpus: int = 1, config: Any = None,
                        **settings: Any) -> float:
    """The model's time of one host AdamW job at a window boundary (ZenFlow, host-owned
    elements of this GPU's rows / host rate). Needs no accelerator facts (the cpu profile
    works), so it can be checked against a measured host update on any machine."""
    cfg = zenflow_config(config, **settings)
    e_host = sum(p.shape[0] * (p.cols - _k(cfg.topk_ratio, p.cols)) for p in wl.params
                 if p.is_matrix(cfg.min_offload_numel))
    return e_host / gpus / hw.host_rate(gpus)


# ---- output -----------------------------------------------------------------------------------
def markdown_table(preds: Mapping[str, Prediction], baseline: str = "zero-offload") -> str:
    """A markdown table of predictions (step, speed-up over ``baseline``, stall, link, host
    busy, memory)."""
    base = preds.get(baseline)
    base_t = base.modelled_step_time_s if base is not None else None
    lines = ["| mode | step (s) | vs " + baseline + " | stall | link GB/step (down + up) | "
             "host busy | device GB | host GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in preds.items():
        t = p.modelled_step_time_s
        step = f"{t:.3f}" if p.fits else f"({t:.3f}) does not fit"
        speed = f"{base_t / t:.2f}x" if base_t and t and p.fits else "-"
        stall = "-" if p.stall_fraction is None else f"{p.stall_fraction:.0%}"
        hb = "-" if p.host_busy_fraction is None else f"{p.host_busy_fraction:.0%}"
        lines.append(f"| {name} | {step} | {speed} | {stall} | "
                     f"{p.link_bytes_per_step / 1e9:.2f} ({p.link_down_bytes_per_step / 1e9:.2f}"
                     f" + {p.link_up_bytes_per_step / 1e9:.2f}) | {hb} | "
                     f"{p.device_memory_bytes / 1e9:.1f} | {p.host_memory_bytes / 1e9:.1f} |")
    return "\n".join(lines)


_COLORS = {"forward": "tab:blue", "backward": "tab:cyan", "grads down": "tab:orange",
           "params up": "tab:green", "host AdamW": "tab:red", "host accumulate": "salmon",
           "wait": "white"}


def plot_timelines(predictions: Mapping[str, Prediction] | Sequence[Prediction],
                   path: str | os.PathLike[str], title: str | None = None) -> Path:
    """One steady-state window per mode as lanes (device, link down, link up, host) on a
    shared time axis; writes a PNG. Needs matplotlib (imported here, lazily)."""
    try:
        import matplotlib
    except ImportError:
        raise StepModelError("plotting needs matplotlib: pip install matplotlib "
                             "(or pip install 'zenflow-triton[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    preds = list(predictions.values()) if isinstance(predictions, Mapping) else list(predictions)
    if not preds:
        raise StepModelError("plot_timelines: no predictions")
    fig, axes = plt.subplots(len(preds), 1, figsize=(11, 1.25 + 1.3 * len(preds)),
                             sharex=True, squeeze=False)
    xmax = max(p.window_time_s for p in preds)
    used: dict[str, str] = {}
    palette = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:gray",
                    "gold", "navy", "teal", "darkkhaki", "slategray"])
    for ax, p in zip(axes[:, 0], preds):
        for row, lane in enumerate(LANES):
            y = len(LANES) - 1 - row
            for s in p.timeline:
                if s.lane != lane or s.duration <= 0:
                    continue
                if s.label not in used:
                    used[s.label] = _COLORS.get(s.label) or next(palette, "black")
                ax.broken_barh([(s.start, s.duration)], (y - 0.4, 0.8),
                               facecolors=used[s.label], edgecolor="none")
        ax.set_yticks(range(len(LANES)))
        ax.set_yticklabels(list(reversed(LANES)), fontsize=8)
        ax.set_xlim(0, xmax * 1.01)
        step = (f"{p.step_time_s:.3f} s/step, stall {p.stall_fraction:.0%}" if p.fits
                else "does not fit in device memory")
        ax.set_title(f"{p.mode}: {p.window_steps} steps, {step}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time in one steady-state window (s)")
    handles = [Patch(color=c, label=lab) for lab, c in used.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97 if title else 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- calibration against public figures -------------------------------------------------------
CALIBRATION_SOURCE = ("DeepSpeed ZenFlow blog, blogs/deepspeed-zenflow/README.md in "
                      "deepspeedai/DeepSpeed (2025): Llama-2-7B fine-tuning on 4x A100")
CALIBRATION_ASSUMPTIONS = dict(
    profile="a100-pcie4", model="llama2-7b", gpus=4, tokens=2048, seq_len=256, mfu=DEFAULT_MFU,
    topk_ratio=0.1, update_interval=4, accumulate_on="host",
    why=("4 GPUs as the blog; tokens per GPU per step 8 x 256 (batch 8 as in DeepSpeedExamples' "
         "ZenFlow Llama-2 fine-tuning script, Alpaca-length sequences: an assumption); MFU the "
         "model's default; ZenFlow topk_ratio=0.1, update_interval=4 as in that script's config; "
         "accumulate_on='host' because DeepSpeed's ZenFlow sums the deferred gradients on the "
         "CPU (they cross every step); host AdamW rate: the a100-pcie4 profile has none, so the "
         "model's default per core (16 cores per GPU x 1e8/s), not fitted to the blog"))


def calibration(**overrides: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The model against the blog's figures: rows of (quantity, published, model, relative
    error), and the assumptions used (``overrides`` change them)."""
    a = {**CALIBRATION_ASSUMPTIONS, **overrides}
    hw = Hardware.from_profile(a["profile"])
    wl = Workload.from_preset(a["model"], tokens=a["tokens"], seq_len=a["seq_len"], mfu=a["mfu"])
    preds = predict_all(hw, wl, gpus=a["gpus"], topk_ratio=a["topk_ratio"],
                        update_interval=a["update_interval"], accumulate_on=a["accumulate_on"])
    n = a["gpus"]
    model_bytes = wl.numel * wl.param_bytes
    zo, zf, ad = preds["zero-offload"], preds["zenflow"], preds["adamw"]
    host_step = (sum(p.numel for p in wl.params if p.is_matrix(4096)) / n) / hw.host_rate(n)
    rows = [
        ("step, all on GPU (s)", 0.5, "about", ad.modelled_step_time_s, "adamw (state sharded)"),
        ("step, ZeRO-Offload (s)", 7.0, "over", zo.modelled_step_time_s, "zero-offload"),
        ("CPU optimizer step, ZeRO-Offload (s)", 4.0, "over", host_step,
         "host AdamW of one GPU's 1/4 shard"),
        ("GPU idle share, ZeRO-Offload", 0.6, "over", zo.stall_fraction, "stall fraction"),
        ("link bytes/step, ZeRO-Offload (x model size)", 2.0, "about",
         zo.link_bytes_per_step * n / model_bytes, "all GPUs' link bytes / bf16 model bytes"),
        ("link bytes/step, ZenFlow (x model size)", 1.13, "about",
         zf.link_bytes_per_step * n / model_bytes, "accumulate_on='host'"),
    ]
    out = [dict(quantity=q, published=v, qualifier=qual, model=m, rel_error=(m - v) / v,
                consistent=(m >= v if qual == "over" else abs(m - v) <= 0.2 * v), note=note)
           for q, v, qual, m, note in rows]
    rate, how = hw.host_rate_and_source(n)
    a["host_adam_elements_per_s_per_gpu"] = rate
    a["host_rate_source"] = how
    a["implied_host_rate_for_4s"] = (sum(p.numel for p in wl.params if p.is_matrix(4096))
                                     / n / 4.0)
    return out, a


def calibration_table(**overrides: Any) -> str:
    rows, a = calibration(**overrides)
    sens = predict(Hardware.from_profile(a["profile"], host_adam_elements_per_s=(
        a["implied_host_rate_for_4s"] * min(a["gpus"], DEFAULT_ACCELERATORS_PER_NODE))),
        Workload.from_preset(a["model"], tokens=a["tokens"], seq_len=a["seq_len"], mfu=a["mfu"]),
        "zero-offload", gpus=a["gpus"])
    lines = [f"Source: {CALIBRATION_SOURCE}.",
             f"Assumptions: profile {a['profile']}, {a['model']}, {a['gpus']} GPUs, "
             f"{a['tokens']} tokens per GPU per step (sequences of {a['seq_len']}), MFU "
             f"{a['mfu']}, host AdamW {a['host_adam_elements_per_s_per_gpu']:.3g} elements/s "
             f"per GPU ({a['host_rate_source']}); ZenFlow topk_ratio={a['topk_ratio']}, "
             f"update_interval={a['update_interval']}, accumulate_on={a['accumulate_on']!r}.",
             "",
             "| quantity | published | model | relative error | consistent | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['quantity']} | {r['qualifier']} {r['published']:g} | "
                     f"{r['model']:.3g} | {r['rel_error']:+.0%} | "
                     f"{'yes' if r['consistent'] else 'no'} | {r['note']} |")
    lines.append("")
    lines.append("consistent: 'over X' holds when the model gives at least X; 'about X' when it "
                 "is within 20% of X.")
    lines.append(f"Sensitivity, not a fit: a host AdamW rate of "
                 f"{a['implied_host_rate_for_4s']:.3g} elements/s per GPU would make the CPU "
                 f"step take the published 4 s; the model's ZeRO-Offload step would then be "
                 f"{sens.modelled_step_time_s:.2f} s (stall {sens.stall_fraction:.0%}).")
    return "\n".join(lines)
