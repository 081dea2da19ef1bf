"""Compile every Triton kernel of the package for a Hopper GPU (sm_90), without a GPU.

Run as a script (``python tests/gpu/gpu_compile_check.py``) with TRITON_INTERPRET unset: the CPU
tests run the kernels in Triton's interpreter, which accepts code that the compiler refuses
(types, pointer casts, constexpr use); this catches that here. ``triton.compile`` with a
``GPUTarget`` needs the CUDA toolchain bundled in Triton's wheel, not a device. Prints one
line per variant and ``compiled N of M``; exits 1 when any variant fails.

Each compiled variant's Triton IR is also checked for index arithmetic that could wrap past
2**31 (:func:`i32_products`): a param, a gradient or the arena may hold more elements than an
int32 counts, so every product that involves a runtime size, stride or count (a kernel's
integer argument, or anything computed from one) must be int64. And its TritonGPU IR for
coalescing (:func:`lanes_across_rows`): every 2-D tile is [rows, k] with a warp's lanes
along k, so the compact device state ([rows, k], row-major) is read and written in whole
128-byte runs per warp, and the param's selected columns of one row share sectors
wherever they are neighbours.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before any @triton.jit runs
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout under test

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tests.support.ir_checks import i32_products, lanes_across_rows, vector_accesses  # noqa: E402
from zenflow_triton.kernels import (accumulate, adamw, column_scores, columns,  # noqa: E402
                                    scatter_multi, selective_adamw, selective_adamw_multi)

FLOAT_ARGS = {"decay", "lerp_w", "beta2", "one_minus_beta2", "eps", "neg_step_size",
              "bc2_sqrt", "scale"}
FP32_PTRS = {"m_ptr", "v_ptr", "master_ptr", "acc_ptr", "out_ptr", "hyper_ptr"}
I64_PTRS = {"idx_ptr", "meta_ptr", "cum_ptr"}
I32_PTRS = {"skip_ptr"}


def signature(fn, p_dtype: str, g_dtype: str) -> dict[str, str]:
    """Argument types by name: the param-side pointers take ``p_dtype``, gradient and source
    pointers ``g_dtype``, state fp32, index tables int64, other scalars int32 or fp32."""
    sig = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name in I64_PTRS:
            sig[name] = "*i64"
        elif name in I32_PTRS:
            sig[name] = "*i32"
        elif name in ("p_ptr", "p_like_ptr", "dst_ptr", "dst_like_ptr"):
            sig[name] = "*" + p_dtype
        elif name.endswith("_ptr"):  # g_ptr, g_like_ptr, src_ptr, src_like_ptr
            sig[name] = "*" + g_dtype
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


KERNELS = [  # (kernel, constexprs given the param dtype[, pointer types overridden])
    (column_scores._column_scores_kernel,
     lambda pd: dict(L1=False, ACCUMULATE=True, BLOCK_R=32, BLOCK_C=64)),
    (accumulate._accumulate_columns_kernel,
     lambda pd: dict(SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64)),
    (accumulate._accumulate_columns_kernel,  # a bf16 accumulator (accumulator_dtype)
     lambda pd: dict(SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64), {"acc_ptr": "*bf16"}),
    (columns._gather_columns_kernel, lambda pd: dict(SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64)),
    (columns._scatter_columns_kernel, lambda pd: dict(SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64)),
    (selective_adamw._selective_adamw_kernel,
     lambda pd: dict(HAS_MASTER=pd != "fp32", SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64)),
    (adamw._adamw_kernel, lambda pd: dict(HAS_MASTER=pd != "fp32", SOFT_BF16=False, BLOCK=2048)),
    (selective_adamw_multi._selective_adamw_accumulate_kernel,
     lambda pd: dict(W=16, SEARCH=8, HAS_MASTER=pd != "fp32", ACC_BF16=False, SOFT_BF16=False,
                     BLOCK_R=32, BLOCK_K=64)),
    (selective_adamw_multi._selective_adamw_accumulate_kernel,
     lambda pd: dict(W=16, SEARCH=8, HAS_MASTER=pd != "fp32", ACC_BF16=True, SOFT_BF16=False,
                     BLOCK_R=32, BLOCK_K=64)),
    (adamw._adamw_multi_kernel,
     lambda pd: dict(W=6, SEARCH=8, HAS_MASTER=pd != "fp32", SOFT_BF16=False, BLOCK=2048)),
    (adamw._adamw_multi_kernel,  # the host vouched for alignment: 128-bit accesses expected
     lambda pd: dict(W=6, SEARCH=8, HAS_MASTER=pd != "fp32", SOFT_BF16=False, BLOCK=2048,
                     ALIGNED=True)),
    (scatter_multi._scatter_columns_multi_kernel,
     lambda pd: dict(W=9, SEARCH=8, SOFT_BF16=False, BLOCK_R=32, BLOCK_K=64)),
]


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    done = total = 0
    for entry, p_dtype, g_dtype in itertools.product(
            KERNELS, ("fp32", "bf16", "fp16"), ("fp32", "bf16")):
        kernel, consts = entry[:2]
        overrides = entry[2] if len(entry) > 2 else {}
        total += 1
        label = (f"{kernel.fn.__name__} p={p_dtype} g={g_dtype} "
                 f"{' '.join(f'{k}={v}' for k, v in consts(p_dtype).items() if k in ('ACC_BF16', 'ALIGNED'))}"
                 f"{' '.join(f'{k}={v}' for k, v in overrides.items())}").rstrip()
        try:
            sig = {**signature(kernel, p_dtype, g_dtype), **overrides}
            compiled = triton.compile(ASTSource(kernel, sig, consts(p_dtype)), target=target,
                                      options={"num_warps": 4})
            wraps = i32_products(compiled.asm["ttir"])
            if wraps:
                print("FAIL", label, "i32 product of a runtime size:", "; ".join(wraps))
                continue
            strided = lanes_across_rows(compiled.asm["ttgir"])
            if strided:
                print("FAIL", label, "a warp's lanes across rows:", "; ".join(strided))
                continue
            if consts(p_dtype).get("ALIGNED") and not vector_accesses(compiled.asm["ptx"]):
                print("FAIL", label, "ALIGNED, yet no 128-bit load and store in the PTX")
                continue
            done += 1
            print("ok  ", label)
        except Exception as e:  # report every variant, then fail
            print("FAIL", label, f"{type(e).__name__}: {str(e)[:800]}")
    print(f"compiled {done} of {total}")
    return 0 if done == total else 1


if __name__ == "__main__":
    sys.exit(main())
