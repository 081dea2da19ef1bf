"""Benchmark session setup: suites register derived figures in bench/_report.py; they are
printed at the end (and written to $ZENFLOW_BENCH_JSON when set)."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _report  # noqa: E402


def pytest_terminal_summary(terminalreporter):
    if not _report.LINES:
        return
    terminalreporter.section(f"zenflow-triton derived figures ({_report.hardware()}"
                             f"{', quick mode' if _report.QUICK else ''})")
    for line in _report.LINES:
        terminalreporter.write_line(line)
    out = os.environ.get("ZENFLOW_BENCH_JSON")
    if out:
        _report.write_json(out)
