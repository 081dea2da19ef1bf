"""Counting the compiled variants a GPU run would make of each Triton kernel, on CPU.

Triton compiles a kernel once per *specialisation*: the constexpr values, the launch
options (``num_warps``), each pointer's element type and 16-byte alignment, and for each
integer argument not listed in ``do_not_specialize`` whether it equals 1 and whether it is
a multiple of 16. A value that changes from step to step in any of these places compiles
a new variant at that step: seconds of stall on a GPU, every time it takes a new value.

:func:`recording` patches each kernel's ``run`` (the entry point of ``kernel[grid](...)``,
in the interpreter and in the JIT alike) to compute, for every launch, the key Triton's JIT
would compute for a Hopper target with Triton's own binder
(``create_function_from_signature`` with the kernel's ``do_not_specialize``), then launches
as usual. No GPU is needed: the NVIDIA backend object only supplies the alignment rule.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import pkgutil
from dataclasses import dataclass

from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, KernelInterface, create_function_from_signature

import zenflow_triton.kernels as kernels_pkg


def package_kernels() -> dict[str, KernelInterface]:
    """Every launchable Triton kernel of ``zenflow_triton.kernels``, by ``module.name``."""
    out = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        mod = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, KernelInterface) and name.endswith("_kernel"):
                out[f"{info.name}.{name}"] = obj
    return out


def _binder(kernel: KernelInterface, backend):
    """Triton's own argument binder for ``kernel``: returns (args, specialisation, options)."""
    fn = getattr(kernel, "fn", kernel)
    opts = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps jit's keywords here
    dns = opts.get("do_not_specialize", getattr(kernel, "do_not_specialize", None))
    dnsa = opts.get("do_not_specialize_on_alignment",
                    getattr(kernel, "do_not_specialize_on_alignment", None))
    jf = JITFunction(fn, do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)
    return create_function_from_signature(jf.signature, jf.params, backend)


@contextlib.contextmanager
def recording(dry: bool = False):
    """``with recording() as rec:`` -> a :class:`Recorded` of the launches made inside.
    ``dry``: record without launching (for tensors that have no memory, on ``meta``)."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    found = package_kernels()
    keys: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    launches: list[tuple[str, tuple]] = []
    saved = {}
    for name, kernel in found.items():
        bind = _binder(kernel, backend)
        original = kernel.run

        def run(*args, grid, warmup, _name=name, _bind=bind, _run=original, **kwargs):
            _, spec, options = _bind(*args, **kwargs)
            key = (tuple(tuple(s) for s in spec), tuple(sorted(options.items())))
            keys[_name][key] += 1
            launches.append((_name, key))
            if dry:
                return None
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        saved[name] = (kernel, "run" in vars(kernel), vars(kernel).get("run"))
        kernel.run = run
    try:
        yield Recorded(keys, launches)
    finally:
        for kernel, had, old in saved.values():
            if had:
                kernel.run = old
            else:
                del kernel.run


@dataclass
class Recorded:
    """What :func:`recording` saw: per kernel name, a Counter of specialisation keys; and
    every launch as ``(kernel name, key)`` in order."""

    keys: dict[str, collections.Counter]
    launches: list[tuple[str, tuple]]

    def distinct(self) -> dict[str, int]:
        """Distinct keys (compiled variants) per kernel that launched."""
        return {name: len(c) for name, c in self.keys.items()}


def describe(key: tuple, kernel: KernelInterface) -> str:
    """A key as ``name=value`` pairs, for assertion messages."""
    names = [p for p in getattr(kernel, "arg_names", None)
             or [x.name for x in JITFunction(kernel.fn).params]]
    spec, options = key
    return ", ".join(f"{n}={s}" for n, s in zip(names, spec)) + f", {dict(options)}"

