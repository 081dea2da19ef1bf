"""Checks on a kernel's Triton IR (text), shared by ``gpu_compile_check.py`` and its tests."""

from __future__ import annotations

import re

_DEF = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (.*)$")
_ARG = re.compile(r"(%[\w.]+): i(?:32|64)\b")


def i32_products(ttir: str) -> list[str]:
    """The ``arith.muli`` lines of ``ttir`` (a kernel's Triton IR) that multiply in i32 a
    value depending on an integer argument of the kernel (a size, stride or count, which
    the host may pass up to 2**31 - 1 as i32 and multiply by a row index) or on an integer
    loaded from memory (a table's sizes and strides, column indices). Products of
    constants and program ids only are bounded by the grid and are left alone."""
    tainted: set[str] = set()
    out = []
    for line in ttir.splitlines():
        if "tt.func" in line:
            tainted |= set(_ARG.findall(line))
            continue
        m = _DEF.match(re.sub(r" loc\(.*\)$", "", line))
        if not m:
            continue
        name, op, rest = m.groups()
        operands = set(re.findall(r"%[\w.]+", rest.split(" : ")[0]))
        if op == "tt.load" and re.search(r"ptr<i(32|64)>+$", rest.split(" : ")[-1].strip()):
            tainted.add(name)  # a size or address read from a table, or column indices
        elif operands & tainted:
            tainted.add(name)
            result_type = rest.rsplit(" : ", 1)[-1]
            if op == "arith.muli" and re.search(r"(?<![0-9])i32(?![0-9])", result_type):
                out.append(m.group(0).strip())
    return out


_LAYOUT = re.compile(r"^(#[\w]+) = #ttg\.blocked<\{(.*)\}>", re.M)
_ACCESS_2D = re.compile(r"(tt\.load|tt\.store) .*: tensor<(\d+)x(\d+)x!tt\.ptr<\w+>, (#\w+)>")


def _ints(field: str, attrs: str) -> list[int]:
    m = re.search(field + r" = \[([\d, ]+)\]", attrs)
    return [int(x) for x in m.group(1).split(",")] if m else []


def lanes_across_rows(ttgir: str, min_run: int = 8) -> list[str]:
    """The 2-D loads and stores of ``ttgir`` (a kernel's TritonGPU IR) whose warps do not
    walk the last dimension: a [rows, k] tile is coalesced when a warp's neighbouring lanes
    read neighbouring elements of one row (``order = [1, 0]``, and at least ``min_run``
    elements of a row per warp: a whole 32-byte sector of fp32). Lanes spread over rows
    read one sector per element of a row-major tensor (16x the bytes for bf16)."""
    layouts = {name: attrs for name, attrs in _LAYOUT.findall(ttgir)}
    out = []
    for m in _ACCESS_2D.finditer(ttgir):
        attrs = layouts.get(m.group(4), "")
        order, lanes = _ints("order", attrs), _ints("threadsPerWarp", attrs)
        per_thread = _ints("sizePerThread", attrs)
        run = (lanes[1] * per_thread[1]) if len(lanes) == 2 and len(per_thread) == 2 else 0
        if order != [1, 0] or run < min(min_run, int(m.group(3))):
            out.append(f"{m.group(1)} tensor<{m.group(2)}x{m.group(3)}> {m.group(4)}: {attrs}")
    return out


def vector_accesses(ptx: str) -> bool:
    """Whether ``ptx`` loads and stores global memory 128 bits at a time (``.v4.b32``):
    what a flat kernel over 16-byte aligned tensors should compile to."""
    return bool(re.search(r"ld\.global[\w.]*\.v4\.b32", ptx)) and \
        bool(re.search(r"st\.global[\w.]*\.v4\.b32", ptx))
