"""The shapes a workload is made of: one parameter's shape (and whether the optimizer splits
it by columns or keeps it on the device) and a layer, the params whose gradients are ready
together in backward with the FLOPs per token they cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

from zenflow_triton.config import matches_any


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
        """Split by columns (else: device-owned, like 1-D params), as partition.py decides:
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
