"""What one GPU trains: the parameter shapes of a workload, from a named preset, an HF
``config.json`` or a ``torch.nn.Module``, its tokens per optimizer step and per micro-batch.

* :class:`ParamSpec` (one param's shape, and whether the optimizer splits it by columns)
  and :class:`Layer` (params whose gradients are ready together, with their FLOPs per
  token);
* :data:`PRESETS`: the named architectures, each from its published config, and how one
  is built into layers;
* :class:`Workload`: what one GPU trains per optimizer step (layers, tokens, micro-batch,
  dtype, MFU, how the loss is computed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from zenflow_triton.config import matches_any

from .inputs import (DEFAULT_MFU, DEFAULT_SEQ_LEN, DEFAULT_TOKENS, DTYPE_BYTES, LOSSES,
                     StepModelError)


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
    loss: str = "logits"
    """How the loss is computed (:data:`~.inputs.LOSSES`): ``logits``, the fp32 logits of the
    micro-batch as an HF causal LM computes them, or ``chunked``, a chunked cross-entropy;
    the activation memory counts its bytes (``activations.activation_bytes``)."""

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
        if self.loss not in LOSSES:
            raise StepModelError(f"loss must be one of {list(LOSSES)}, got {self.loss!r}")

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
