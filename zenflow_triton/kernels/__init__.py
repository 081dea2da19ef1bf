"""The device half's compute ops: the one door between the optimizer and the kernels.

The optimizer asks ``get_ops(backend)`` for a :class:`KernelOps` and calls only its fields.
Each op lives in its own file (Triton kernel -> launcher -> torch reference ``*_ref``);
the torch references define the semantics and are what tests compare the Triton kernels to.

Signatures (all in place unless they return):

* ``column_scores(g2d, norm, out=None) -> fp32 [cols]``: sum over rows of g**2 ("l2") or
  |g| ("l1"), added into ``out`` when given.
* ``selective_adamw(p2d, g2d, idx, m, v, master, *, lr, beta1, beta2, eps, weight_decay,
  step)``: AdamW on columns ``idx`` of ``p2d`` with compact fp32 state [rows, k].
* ``selective_adamw_accumulate(p2ds, g2ds, dev_idxs, ms, vs, masters, steps, accs,
  host_idxs, *, lr, beta1, beta2, eps, weight_decay)``: the device half of a step for many
  matrix params sharing the hyperparameters: selective AdamW on each one's device-owned
  columns and ``accs[i] += g2ds[i][:, host_idxs[i]]`` (skipped where ``accs[i]`` is None),
  reading each gradient once; one launch per dtype pair on the Triton backend. ``skip``
  (keyword, optional): an int32 [1] flag on the device; nonzero makes the op write nothing
  (the Triton kernels read it on the device, the references on the host).
* ``adamw(params, grads, ms, vs, masters, steps, *, lr, beta1, beta2, eps, weight_decay)``:
  full AdamW over a list of tensors sharing the hyperparameters (one launch per dtype pair);
  ``skip`` as above.
* ``accumulate_columns(acc, g2d, idx, scale)``: acc += scale * g2d[:, idx] (fp32 acc).
* ``gather_columns(src2d, idx, dtype=None) -> [rows, k]`` and
  ``scatter_columns(dst2d, idx, src)``: column moves with a cast.
* ``scatter_columns_multi(dst2ds, idxs, srcs)``: ``scatter_columns`` for many params (the
  apply of a window), one launch per dtype pair on the Triton backend.

Shared by both backends: ``nonfinite_flags(grads, exact=False) -> bool [n]`` on the device
(``finite.py``: one multi-tensor reduction, no host sync; a superset, which
``confirm_nonfinite(grad)`` checks exactly, or exact with ``exact=True``).
"""

from __future__ import annotations

import os

from .accumulate import accumulate_columns_ref
from .adamw import adamw_ref
from .column_scores import column_scores_ref
from .columns import gather_columns_ref, scatter_columns_ref
from .finite import confirm as confirm_nonfinite
from .finite import nonfinite_flags
from .ops import KernelOps
from .scatter_multi import scatter_columns_multi_ref
from .selective_adamw import selective_adamw_ref
from .selective_adamw_multi import selective_adamw_accumulate_ref

BACKENDS = ("torch", "triton")


TORCH_OPS = KernelOps(
    name="torch",
    column_scores=column_scores_ref,
    selective_adamw=selective_adamw_ref,
    selective_adamw_accumulate=selective_adamw_accumulate_ref,
    adamw=adamw_ref,
    accumulate_columns=accumulate_columns_ref,
    gather_columns=gather_columns_ref,
    scatter_columns=scatter_columns_ref,
    scatter_columns_multi=scatter_columns_multi_ref,
)


def triton_available() -> tuple[bool, str]:
    """Whether the Triton backend can run here, and why not when it cannot."""
    try:
        from . import triton_ops  # noqa: F401  (registers the torch.library ops)
    except ImportError as e:  # kernels not built into this install, or triton missing
        return False, f"Triton backend unavailable: {e}"
    return True, ""


def resolve_backend(want: str, params) -> str:
    """The backend a config's ``backend`` means for these params: "auto" is "triton" where a
    param lives on a CUDA/ROCm device and Triton can run, else "torch"; RuntimeError saying
    why when "triton" is asked for and cannot run."""
    if want == "auto":
        on_gpu = any(p.device.type == "cuda" for p in params)
        return "triton" if on_gpu and triton_available()[0] else "torch"
    if want == "triton":
        ok, why = triton_available()
        if not ok:
            raise RuntimeError(f'backend="triton" requested but {why}')
        devices = sorted({p.device.type for p in params})
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # kernels on CPU tensors
        if devices and "cuda" not in devices and not interpreted:
            raise ValueError(f'backend="triton" needs params on a CUDA or ROCm device; these '
                             f"are on {', '.join(devices)} (use backend=\"torch\" or "
                             '"auto"; TRITON_INTERPRET=1 runs the kernels on CPU tensors, '
                             "slowly, for tests)")
    return want


def get_ops(backend: str) -> KernelOps:
    """The ops of ``backend`` ("torch" or "triton")."""
    if backend == "torch":
        return TORCH_OPS
    if backend == "triton":
        ok, why = triton_available()
        if not ok:
            raise RuntimeError(why)
        from .triton_ops import TRITON_OPS
        return TRITON_OPS
    raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
