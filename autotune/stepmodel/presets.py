"""The named model architectures (Llama 2 7B and 13B, Qwen2.5 3B, OPT 350M), each from its
published config, and how one is built into layers of param shapes with their FLOPs per
token (matmuls plus attention)."""

from __future__ import annotations

from typing import Any, Mapping

from .base import StepModelError
from .shapes import Layer, ParamSpec


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
