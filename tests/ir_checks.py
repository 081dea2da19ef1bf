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
