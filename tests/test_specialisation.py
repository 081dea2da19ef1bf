"""Compiled variants per run: bounded by the dtype/shape classes, not by the steps.

Triton compiles a kernel anew for every new specialisation key (``tests/specialisations.py``
computes the key its JIT would, for a Hopper target, on CPU). A value that varies from step
to step (lr and the bias corrections, how many columns move at a reselection, how many
params of a launch have work, a param group added mid-run) must not reach the key: on a GPU
every new value would stall the step for a compile.
"""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU
MULTI = ("scatter_multi._scatter_columns_multi_kernel",
         "selective_adamw_multi._selective_adamw_accumulate_kernel",
         "adamw._adamw_multi_kernel")


def _keys(run):
    from .support.specialisations import recording
    with recording() as rec:
        run()
    return rec


def test_launchers_key_by_shape_not_by_counts():
    """The launchers called with the counts a run varies, on fixed shapes: one key each.
    ``k`` (columns moved) takes 1 (which Triton would make a constant), 16 and 32 (multiples
    of 16), 5 and 17; a multi-tensor launch takes 1, 2 and 5 tensors of one shape."""
    from zenflow_triton.kernels import columns, scatter_multi

    gen = torch.Generator().manual_seed(0)
    dst = torch.randn(24, 40, generator=gen).to(DEVICE)
    counts = (1, 5, 16, 17, 32)

    def run():
        for k in counts:
            idx = torch.randperm(40, generator=gen)[:k].sort().values.to(DEVICE)
            out = columns.gather_columns(dst, idx)
            columns.scatter_columns(dst, idx, out)
        for n in (1, 2, 5):
            dsts = [torch.randn(24, 40, generator=gen).to(DEVICE) for _ in range(n)]
            idxs = [torch.randperm(40, generator=gen)[:k].sort().values.to(DEVICE)
                    for k in counts[:n]]
            scatter_multi.scatter_columns_multi(
                dsts, idxs, [torch.randn(24, i.numel()).to(DEVICE) for i in idxs])

    rec = _keys(run)
    assert rec.distinct() == {"columns._gather_columns_kernel": 1,
                              "columns._scatter_columns_kernel": 1,
                              "scatter_multi._scatter_columns_multi_kernel": 1}, _explain(rec)


def _explain(rec) -> str:
    from .support.specialisations import describe, package_kernels
    kernels = package_kernels()
    return "\n".join(f"{name}: {describe(key, kernels[name])}"
                     for name, c in rec.keys.items() for key in c)


def test_a_run_compiles_per_class_not_per_step():
    """100 steps on the Triton backend: lr changes every step, a reselection every 4 steps
    moves a varying number of columns, a param group with another shape joins at step 40.
    (k itself is fixed per param by ``topk_ratio``; what a reselection varies is how many
    columns move.) No kernel gets a new key after step 50, and each has at most one key per
    class: a per-param kernel one per split matrix shape, a multi-tensor kernel one per param
    group (its tile follows the group's largest shape)."""
    from .support.specialisations import recording

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24),
                                torch.nn.Linear(24, 8)).to(DEVICE)
    extra = torch.nn.Linear(33, 20).to(DEVICE)
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2,
                           select_interval=4, min_offload_numel=64, backend="triton")
    gen = torch.Generator().manual_seed(1)
    first_seen: dict[tuple, int] = {}
    try:
        with recording() as rec:
            for t in range(1, 101):
                if t == 40:
                    opt.add_param_group({"params": list(extra.parameters()), "lr": 5e-4})
                params = list(model.parameters()) + (list(extra.parameters()) if t >= 40
                                                     else [])
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
                before = len(rec.launches)
                opt.step()
                for group in opt.param_groups:
                    group["lr"] = 1e-3 / (1 + t)
                for name_key in rec.launches[before:]:
                    first_seen.setdefault(name_key, t)
        stats = opt.stats()
    finally:
        opt.close()
    assert stats["selection_refreshes"] >= 20 and stats["columns_migrated"] > 100
    late = {nk: t for nk, t in first_seen.items() if t > 50}
    assert not late, f"new variants after step 50: {late}\n{_explain(rec)}"
    shapes = {tuple(p.shape) for p in list(model.parameters()) + list(extra.parameters())
              if p.dim() == 2 and p.numel() >= 64}
    for name, n in rec.distinct().items():
        bound = len(opt.param_groups) if name in MULTI else len(shapes)
        assert n <= bound, f"{name}: {n} variants > {bound}\n{_explain(rec)}"
    assert set(MULTI) <= set(rec.distinct()), rec.distinct()


def test_no_kernel_is_autotuned():
    """An autotuned kernel that updates in place would run each trial config on the same
    buffers (AdamW applied several times) unless it restores them (``restore_value``); and
    its chosen configs would have to travel with the profile. None is autotuned: tiles come
    from ``kernels._launch``'s heuristics. This fails if one becomes an Autotuner, so that
    the change makes those two decisions."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    from .support.specialisations import package_kernels

    kernels = package_kernels()
    assert len(kernels) >= 9, sorted(kernels)
    tuned = [name for name, k in kernels.items() if isinstance(k, (Autotuner, Heuristics))]
    assert not tuned, tuned
