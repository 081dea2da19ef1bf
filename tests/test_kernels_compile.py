"""Every Triton kernel compiles for a Hopper GPU (sm_90), checked on a machine without one.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler
refuses; ``tests/gpu_compile_check.py`` compiles each kernel for every pair of param and
grad dtypes with ``triton.compile`` and a ``GPUTarget`` (the toolchain ships in Triton's
wheel). It runs in a subprocess because the kernels must be decorated without
TRITON_INTERPRET, which this test session sets.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nvidia_backend() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        from triton.backends.nvidia import compiler as nv  # noqa: F401
    except Exception as e:  # a Triton build without the NVIDIA backend
        return False, f"Triton's NVIDIA backend is unavailable: {e}"
    return True, ""


@pytest.mark.skipif(not _nvidia_backend()[0], reason=_nvidia_backend()[1])
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_compile_check.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert proc.returncode == 0 and not fails, "\n".join(fails) or out[-4000:]
    assert "compiled 72 of 72" in out, out[-2000:]


def test_i32_products_flags_runtime_sizes_only():
    """The IR rule ``gpu_compile_check.py`` applies to every compiled variant: an i32
    product of a kernel argument, or of an integer loaded from a table, is flagged (scalar
    or tensor); one of constants and the program id only is not, nor an i64 product."""
    from .support.ir_checks import i32_products

    ir = """
  tt.func public @k(%p: !tt.ptr<f32> loc("p"(#loc)), %rows: i32 loc("rows"(#loc))) {
    %c = arith.constant 64 : i32 loc(#loc1)
    %0 = tt.get_program_id x : i32 loc(#loc2)
    %1 = arith.muli %0, %c : i32 loc(#loc3)
    %2 = arith.divsi %0, %rows : i32 loc(#loc4)
    %3 = arith.muli %2, %c : i32 loc(#loc5)
    %4 = arith.extsi %2 : i32 to i64 loc(#loc6)
    %5 = arith.muli %4, %4 : i64 loc(#loc7)
    %6 = tt.load %t : !tt.ptr<i64> loc(#loc8)
    %7 = arith.trunci %6 : i64 to i32 loc(#loc9)
    %8 = tt.splat %7 : i32 -> tensor<64xi32> loc(#loc10)
    %9 = arith.muli %r, %8 : tensor<64xi32> loc(#loc11)
"""
    assert i32_products(ir) == ["%3 = arith.muli %2, %c : i32",
                                "%9 = arith.muli %r, %8 : tensor<64xi32>"]


def test_lanes_across_rows_flags_warps_that_do_not_walk_a_row():
    """The coalescing rule ``gpu_compile_check.py`` applies to every compiled variant: a
    2-D access whose layout puts a warp's lanes along the last dimension (order [1, 0], 32
    or at least 8 elements of a row) passes; lanes across rows (order [0, 1], or 1 element
    of each of 32 rows) are flagged; 1-D accesses are not 2-D tiles."""
    from .support.ir_checks import lanes_across_rows

    ir = """
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [2, 2], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [32, 1], warpsPerCTA = [2, 2], order = [1, 0]}>
#blocked2 = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, 4], order = [0, 1]}>
#blocked3 = #ttg.blocked<{sizePerThread = [1, 4], threadsPerWarp = [4, 8], warpsPerCTA = [4, 1], order = [1, 0]}>
#blocked4 = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]}>
    %m = tt.load %0, %mask : tensor<32x64x!tt.ptr<f32>, #blocked> loc(#loc1)
    tt.store %1, %x, %mask : tensor<32x64x!tt.ptr<f32>, #blocked1> loc(#loc2)
    %g = tt.load %2, %mask : tensor<32x64x!tt.ptr<bf16>, #blocked2> loc(#loc3)
    %v = tt.load %3, %mask : tensor<16x32x!tt.ptr<f32>, #blocked3> loc(#loc4)
    %i = tt.load %4, %mk : tensor<64x!tt.ptr<i64>, #blocked4> loc(#loc5)
"""
    flagged = lanes_across_rows(ir)
    assert len(flagged) == 2
    assert flagged[0].startswith("tt.store tensor<32x64> #blocked1")
    assert flagged[1].startswith("tt.load tensor<32x64> #blocked2")
