"""GPU discipline, counted on CPU (tests/counting.py): a step's host syncs do not grow with
the number of params, and on the Triton backend neither do its launches.

A model of N Linear(32, 32) layers: N matrices and N biases, every matrix split between
device- and host-owned columns. Counted at a steady step, at a window boundary whose
host result is applied, and at a reselection (which also applies), for N = 16 and 64.
"""

from __future__ import annotations

import functools

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

from .counting import count_step

SIZES = (16, 64)
# Windows of 2, reselection every 4: t = 3 is steady; t = 4 a boundary that applies the window
# of t = 2 (overlap) or its own (overlap=False); t = 5 (u - 1 = 4) a reselection.
STEADY, APPLY, RESELECT = 3, 4, 5
BACKENDS = ["torch"] + (["triton"] if triton_available()[0] else [])
# On a GPU machine (bench/gpu_check.sh) the same counts on CUDA tensors, kernels compiled.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def run_counting(n_layers: int, backend: str, dtype=torch.float32, overlap=True,
                 accumulate_on="device"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(n_layers)]).to(
        device=DEVICE, dtype=dtype)
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2,
                           select_interval=4, min_offload_numel=64, backend=backend,
                           overlap=overlap, accumulate_on=accumulate_on)
    gen = torch.Generator().manual_seed(1)
    counts = {}
    try:
        for t in range(1, RESELECT + 1):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(device=DEVICE, dtype=dtype)
            if t in (STEADY, APPLY, RESELECT):
                counts[t] = count_step(opt)
            else:
                opt.step()
        stats = opt.stats()
    finally:
        opt.close()
    assert stats["host_updates"] == 2 and stats["selection_refreshes"] == 2
    assert stats["columns_migrated"] > 0  # the reselection really moved columns
    return counts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [dict(overlap=True), dict(overlap=False),
                                 dict(overlap=True, dtype=torch.bfloat16),
                                 dict(overlap=True, dtype=torch.bfloat16,
                                      accumulate_on="host")],
                         ids=["overlap", "sync", "overlap-bf16", "host-acc-bf16"])
def test_host_syncs_do_not_grow_with_params(backend, cfg):
    """At most 2 host-blocking calls on a steady step and on an applying boundary, at most 4
    on a reselection, for 16 and for 64 matrices (the finite check reads one flag vector;
    the apply copies one arena per dtype, non-blocking; a reselection reads the picks and
    the leaving columns in one copy each)."""
    for n in SIZES:
        counts = run_counting(n, backend, **cfg)
        for t, bound in ((STEADY, 2), (APPLY, 2), (RESELECT, 4)):
            c = counts[t]
            assert c.syncs <= bound, (f"{n} matrices, step {t}: {c.syncs} host syncs > "
                                      f"{bound}: {c.sync_sites}")
            if t != RESELECT:  # steady and applying steps wait for no transfer at all
                assert "a blocking transfer (Link)" not in c.sync_sites, (n, t, c.sync_sites)


@pytest.mark.skipif("triton" not in BACKENDS, reason=triton_available()[1])
@pytest.mark.parametrize("cfg", [dict(overlap=True), dict(overlap=False),
                                 dict(overlap=True, dtype=torch.bfloat16)],
                         ids=["overlap", "sync", "overlap-bf16"])
def test_triton_launches_grow_with_groups_not_params(cfg):
    """Work-launching ops (dispatched aten and custom ops other than views, plus Triton
    kernel launches) of a steady step and of an applying boundary: 64 matrices cost at
    most 1.5x what 16 cost."""
    small, large = (run_counting(n, "triton", **cfg) for n in SIZES)
    for t in (STEADY, APPLY):
        a, b = small[t], large[t]
        assert b.ops <= 1.5 * a.ops, (f"step {t}: {a.ops} ops for {SIZES[0]} matrices, "
                                      f"{b.ops} for {SIZES[1]}: {b.op_names}")


def test_counting_sees_syncs_in_library_code_only():
    """Guards the counter: the single-param migrate (kept for tests) reads the new indices
    back with .cpu() and the leaving columns with a blocking copy, in library code: both
    counted; a test's own .item() is not the library's and is not counted."""
    from zenflow_triton.kernels import get_ops
    from zenflow_triton.partition import init_matrix_state, migrate
    from zenflow_triton.transfer import Link

    from .counting import counting

    p, link = torch.randn(6, 10), Link()
    st = init_matrix_state(p, link)
    migrate(p, st, torch.tensor([1, 4]), beta1=0.9, beta2=0.999, ops=get_ops("torch"),
            link=link)
    with counting(link) as c:
        torch.ones(()).item()  # the test's, not the library's
        migrate(p, st, torch.tensor([2, 4]), beta1=0.9, beta2=0.999, ops=get_ops("torch"),
                link=link)
    assert any(".cpu() at partition.py" in s for s in c.sync_sites), c.sync_sites
    assert "a blocking transfer (Link)" in c.sync_sites
    assert c.syncs == 2, c.sync_sites
