"""``KernelOps``: the device ops behind one door, one instance per backend (``TORCH_OPS``,
the references; ``triton_ops.TRITON_OPS``, the kernels), with the same signatures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelOps:
    name: str
    column_scores: Callable
    selective_adamw: Callable
    selective_adamw_accumulate: Callable
    adamw: Callable
    accumulate_columns: Callable
    gather_columns: Callable
    scatter_columns: Callable
    scatter_columns_multi: Callable
