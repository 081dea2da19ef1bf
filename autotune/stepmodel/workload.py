"""What one GPU trains per optimizer step: the layers of param shapes, the tokens, the param
dtype and the MFU. Built from a named preset or from the param shapes of a real
``torch.nn.Module``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import _DTYPE_BYTES, DEFAULT_MFU, DEFAULT_SEQ_LEN, DEFAULT_TOKENS, StepModelError
from .presets import PRESETS, _build_preset
from .shapes import Layer, ParamSpec


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
