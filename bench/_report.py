"""Derived figures that benchmark suites register, printed once at the end of the session;
and the model the step benchmarks share (:func:`linear_stack`)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

QUICK = os.environ.get("ZENFLOW_BENCH_QUICK") == "1"
LINES: list[str] = []
ROWS: list[dict] = []


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU only"


def add(row: dict, line: str) -> None:
    ROWS.append(row)
    LINES.append(line)


def write_json(path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps({"hardware": hardware(), "quick": QUICK, "rows": ROWS},
                                     indent=2))


def linear_stack(width: int, layers: int) -> torch.nn.Module:
    """``layers`` square ``nn.Linear(width, width)`` with fixed random gradients (seeded), so
    a benchmark can time ``step()`` alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return model
