"""Derived figures that benchmark suites register, printed once at the end of the session."""

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
