"""Triton kernels against their torch references (``TORCH_OPS``), op by op.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py);
on a GPU they run compiled. Tolerances:

* fp32 outputs: within 1e-6 of the torch reference, relative to the tensor's largest value;
* every output: its error against an fp64 "gold" computation is at most 2x the error the
  torch reference makes against the same gold (flash-attention's layer-norm criterion), so a
  bf16/fp16 result may differ from torch only by the rounding torch itself does;
* pure data movement (gather/scatter): bit for bit.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from zenflow_triton.kernels import TORCH_OPS, triton_available

ok, why = triton_available()
if not ok:
    pytest.skip(why, allow_module_level=True)

from zenflow_triton.kernels.triton_ops import TRITON_OPS  # noqa: E402

from .support.helpers import tree_env  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 1x1; odd width with a single row block; many rows, few columns (row-split reduction, 33
# columns < one column block); and a small square-ish one.
SHAPES = [(1, 1), (7, 1023), (4097, 33), (33, 70)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _ids(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, tuple):
        return "x".join(map(str, x))
    return str(x)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def pick(cols: int, k: int, seed: int = 0) -> torch.Tensor:
    """k sorted distinct column indices."""
    return torch.randperm(cols, generator=_gen(seed))[:k].sort().values.to(DEVICE)


def k_values(cols: int) -> list[int]:
    return sorted({0, 1, max(1, cols // 5), cols})


def check(out: torch.Tensor, ref: torch.Tensor, gold: torch.Tensor, what: str) -> None:
    """out (Triton) vs ref (torch reference) vs gold (fp64), see the module docstring."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    gold = gold.double().cpu().reshape(ref.shape)
    o, r = out.double().cpu(), ref.double().cpu()
    scale = gold.abs().max().item() if gold.numel() else 0.0
    slack = 1e-6 * scale + 1e-30
    if out.dtype == torch.float32:
        diff = (o - r).abs().max().item() if o.numel() else 0.0
        assert diff <= slack, f"{what}: |triton - torch| = {diff:.3g} > 1e-6 * {scale:.3g}"
    err = (o - gold).abs().max().item() if o.numel() else 0.0
    ref_err = (r - gold).abs().max().item() if o.numel() else 0.0
    assert err <= 2 * ref_err + slack, (
        f"{what}: error vs fp64 {err:.3g} > 2x torch's error {ref_err:.3g}")


def gold_adamw(w, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    """AdamW in fp64, written from the formula (independent of adamw_math)."""
    w, g, m, v = (t.double().cpu() for t in (w, g, m, v))
    w = w * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    return w - lr / (1 - beta1 ** step) * m / denom, m, v


# --- column_scores ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_column_scores(shape, dtype, norm):
    g = randn(*shape, dtype=dtype, seed=1)
    g64 = g.double().cpu()
    gold = g64.square().sum(0) if norm == "l2" else g64.abs().sum(0)
    check(TRITON_OPS.column_scores(g, norm), TORCH_OPS.column_scores(g, norm), gold, "scores")
    # Added into a running total, which is also returned.
    base = randn(shape[1], seed=2).abs()
    out, out_ref = base.clone(), base.clone()
    assert TRITON_OPS.column_scores(g, norm, out) is out
    TORCH_OPS.column_scores(g, norm, out_ref)
    check(out, out_ref, base.double().cpu() + gold, "scores into out")


def test_column_scores_deterministic_and_strided():
    # Non-contiguous input is supported (strides are kernel arguments), results are bitwise
    # reproducible (no atomics in the row-split reduction).
    base = randn(4097, 66, dtype=torch.bfloat16, seed=3)
    g = base[:, ::2]
    assert not g.is_contiguous()
    a = TRITON_OPS.column_scores(g)
    assert torch.equal(a, TRITON_OPS.column_scores(g))
    check(a, TORCH_OPS.column_scores(g), g.double().cpu().square().sum(0), "strided scores")
    gt = randn(33, 50, seed=4).t()  # transposed view: [50, 33], strides (1, 50)
    check(TRITON_OPS.column_scores(gt, "l1"), TORCH_OPS.column_scores(gt, "l1"),
          gt.double().cpu().abs().sum(0), "transposed scores")


# --- selective_adamw -------------------------------------------------------------------------

def _selective_case(shape, dtype, k, seed=0, step=3):
    rows, cols = shape
    p = randn(rows, cols, dtype=dtype, seed=seed)
    g = randn(rows, cols, dtype=dtype, seed=seed + 1)
    idx = pick(cols, k, seed)
    m = randn(rows, k, seed=seed + 2, scale=0.1)
    v = randn(rows, k, seed=seed + 3, scale=0.1).square()
    master = (p.index_select(1, idx).float() + randn(rows, k, seed=seed + 4, scale=1e-3)
              if dtype != torch.float32 else None)
    return p, g, idx, m, v, master


def _clone(ts):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.parametrize("shape", SHAPES[:3], ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("kind", ["k0", "k1", "some", "all"])
def test_selective_adamw(shape, dtype, kind):
    cols = shape[1]
    k = {"k0": 0, "k1": 1, "some": max(1, cols // 5), "all": cols}[kind]
    step = 7
    args = _selective_case(shape, dtype, k, step=step)
    p, g, idx, m, v, master = args
    tri, ref = _clone(args), _clone(args)
    TRITON_OPS.selective_adamw(*tri, **HP, step=step)
    TORCH_OPS.selective_adamw(*ref, **HP, step=step)

    w0 = master if master is not None else p.index_select(1, idx)
    w_gold, m_gold, v_gold = gold_adamw(w0, g.index_select(1, idx), m, v, **HP, step=step)
    p_gold = p.double().cpu()
    p_gold[:, idx.cpu()] = w_gold
    check(tri[0], ref[0], p_gold, "p")
    check(tri[3], ref[3], m_gold, "m")
    check(tri[4], ref[4], v_gold, "v")
    if master is not None:
        check(tri[5], ref[5], w_gold, "master")
    # Columns outside idx untouched, bit for bit.
    rest = torch.ones(cols, dtype=torch.bool, device=DEVICE)
    rest[idx] = False
    assert torch.equal(tri[0][:, rest], p[:, rest])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_selective_adamw_strided_and_hyperparams(dtype):
    # p2d a strided view (a column slice of a wider tensor), g2d transposed-contiguous;
    # beta1 < 0.5 takes lerp's other branch; step 1 and no weight decay.
    rows, cols, k = 37, 50, 9
    big = randn(rows, 2 * cols, dtype=dtype, seed=5)
    g = randn(cols, rows, dtype=dtype, seed=6).t()
    idx = pick(cols, k, 1)
    m = randn(rows, k, seed=7, scale=0.1)
    v = randn(rows, k, seed=8, scale=0.1).square()
    hp = dict(lr=3e-3, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.0)
    bt, br = big.clone(), big.clone()
    master = big[:, :cols].index_select(1, idx).float() if dtype != torch.float32 else None
    tri = [bt[:, :cols], g, idx, m.clone(), v.clone(), _clone([master])[0]]
    ref = [br[:, :cols], g, idx, m.clone(), v.clone(), _clone([master])[0]]
    assert not tri[0].is_contiguous() and not g.is_contiguous()
    TRITON_OPS.selective_adamw(*tri, **hp, step=1)
    TORCH_OPS.selective_adamw(*ref, **hp, step=1)
    w0 = big[:, :cols].index_select(1, idx) if master is None else master
    w_gold, m_gold, v_gold = gold_adamw(w0, g.index_select(1, idx), m, v, **hp, step=1)
    p_gold = big.double().cpu()
    p_gold[:, idx.cpu()] = w_gold
    check(bt, br, p_gold, "p")
    check(tri[3], ref[3], m_gold, "m")
    check(tri[4], ref[4], v_gold, "v")


def test_selective_adamw_rejects_bad_state():
    p, g, idx, m, v, _ = _selective_case((8, 10), torch.float32, 3)
    with pytest.raises(ValueError, match="m must be a contiguous fp32"):
        TRITON_OPS.selective_adamw(p, g, idx, m.t().contiguous().t(), v, None, **HP, step=1)
    with pytest.raises(ValueError, match="v must be a contiguous fp32"):
        TRITON_OPS.selective_adamw(p, g, idx, m, v.double(), None, **HP, step=1)


# --- adamw -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_adamw(dtype):
    shapes = [(1,), (1023,), (33, 7), (5000,), (2, 3, 4)]
    steps = [1, 2, 5, 10, 1000]
    low = dtype != torch.float32
    ps = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)]
    gs = [randn(*s, dtype=dtype, seed=10 + i) for i, s in enumerate(shapes)]
    ms = [randn(*s, seed=20 + i, scale=0.1) for i, s in enumerate(shapes)]
    vs = [randn(*s, seed=30 + i, scale=0.1).square() for i, s in enumerate(shapes)]
    masters = [p.float() + randn(*p.shape, seed=40 + i, scale=1e-3) if low else None
               for i, p in enumerate(ps)]
    tri = [_clone(x) for x in (ps, gs, ms, vs, masters)]
    ref = [_clone(x) for x in (ps, gs, ms, vs, masters)]
    TRITON_OPS.adamw(*tri, steps, **HP)
    TORCH_OPS.adamw(*ref, steps, **HP)
    for i in range(len(shapes)):
        w0 = masters[i] if low else ps[i]
        w_gold, m_gold, v_gold = gold_adamw(w0, gs[i], ms[i], vs[i], **HP, step=steps[i])
        check(tri[0][i], ref[0][i], w_gold, f"p[{i}]")
        check(tri[2][i], ref[2][i], m_gold, f"m[{i}]")
        check(tri[3][i], ref[3][i], v_gold, f"v[{i}]")
        if low:
            check(tri[4][i], ref[4][i], w_gold, f"master[{i}]")


def test_adamw_strided_grad_and_bad_param():
    p = randn(20, 30, seed=1)
    g = randn(30, 20, seed=2).t()  # strided grad: copied to contiguous by the launcher
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    tri, ref = _clone([p, m, v]), _clone([p, m, v])
    TRITON_OPS.adamw([tri[0]], [g], [tri[1]], [tri[2]], [None], [1], **HP)
    TORCH_OPS.adamw([ref[0]], [g], [ref[1]], [ref[2]], [None], [1], **HP)
    w_gold, _, _ = gold_adamw(p, g, m, v, **HP, step=1)
    check(tri[0], ref[0], w_gold, "p")
    # In-place outputs must be contiguous: rejected with a message naming the tensor.
    pt = randn(30, 20, seed=3).t()
    with pytest.raises(ValueError, match=r"params\[0\] must be a contiguous"):
        TRITON_OPS.adamw([pt], [g], [m], [v], [None], [1], **HP)
    TRITON_OPS.adamw([], [], [], [], [], [], **HP)  # empty list: no-op


# --- accumulate_columns ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_accumulate_columns(shape, dtype):
    rows, cols = shape
    g = randn(rows, cols, dtype=dtype, seed=1)
    for k in k_values(cols):
        idx = pick(cols, k, seed=k)
        acc = randn(rows, k, seed=2)
        for scale in (1.0, 0.25):
            a, r = acc.clone(), acc.clone()
            TRITON_OPS.accumulate_columns(a, g, idx, scale)
            TORCH_OPS.accumulate_columns(r, g, idx, scale)
            gold = acc.double().cpu() + scale * g.double().cpu()[:, idx.cpu()]
            check(a, r, gold, f"acc k={k} scale={scale}")


def test_accumulate_columns_strided():
    base = randn(40, 90, dtype=torch.float16, seed=3)
    g = base[:, 1::3]  # column stride 3, offset 1
    idx = pick(30, 11)
    acc = randn(40, 11, seed=4)
    a, r = acc.clone(), acc.clone()
    TRITON_OPS.accumulate_columns(a, g, idx)
    TORCH_OPS.accumulate_columns(r, g, idx)
    check(a, r, acc.double().cpu() + g.double().cpu()[:, idx.cpu()], "acc strided")


# --- gather / scatter ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_gather_scatter_columns(shape, dtype):
    rows, cols = shape
    src = randn(rows, cols, dtype=dtype, seed=1)
    for k in k_values(cols):
        idx = pick(cols, k, seed=k)
        for out_dtype in (None, *DTYPES):
            a = TRITON_OPS.gather_columns(src, idx, out_dtype)
            r = TORCH_OPS.gather_columns(src, idx, out_dtype)
            assert a.is_contiguous() and a.shape == (rows, k)
            assert a.dtype == r.dtype and torch.equal(a, r), (k, out_dtype)
        # scatter an fp32 source (the host master): rounding to dtype is torch's, bit for bit
        vals = randn(rows, k, seed=2)
        d, e = src.clone(), src.clone()
        TRITON_OPS.scatter_columns(d, idx, vals)
        TORCH_OPS.scatter_columns(e, idx, vals)
        assert torch.equal(d, e), k


def test_gather_scatter_strided():
    big = randn(30, 80, dtype=torch.bfloat16, seed=5)
    view = big[:, 10:60]  # row stride 80
    idx = pick(50, 13)
    assert torch.equal(TRITON_OPS.gather_columns(view, idx, torch.float32),
                       TORCH_OPS.gather_columns(view, idx, torch.float32))
    vals = randn(13, 30, seed=6).t()  # strided source
    b1, b2 = big.clone(), big.clone()
    TRITON_OPS.scatter_columns(b1[:, 10:60], idx, vals)
    TORCH_OPS.scatter_columns(b2[:, 10:60], idx, vals)
    assert torch.equal(b1, b2)


def test_bf16_rounding_ties_and_specials():
    # Round-to-nearest-even at ties, overflow to inf, NaN stays NaN (the interpreter's own
    # fp32->bf16 cast truncates; the kernels must round like torch and like GPUs do).
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF,
                         0xFF7FFFFF, 0x7FC00000, 0x7F800001, 0x00008000, 0x80018000],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    src = bits.reshape(1, -1).to(DEVICE)
    idx = torch.arange(src.shape[1], device=DEVICE)
    a = TRITON_OPS.gather_columns(src, idx, torch.bfloat16)
    r = TORCH_OPS.gather_columns(src, idx, torch.bfloat16)
    nan = r.isnan()  # NaN payloads may differ between implementations; NaN-ness may not
    assert torch.equal(a.isnan(), nan)
    assert torch.equal(a[~nan].view(torch.int16), r[~nan].view(torch.int16))


# --- registration, torch.compile, import without Triton --------------------------------------

# Expected mutated arguments of each registered op (the alias annotations "(a!)").
OPS_MUTATES = {
    "column_scores": set(),
    "column_scores_add_": {"out"},
    "selective_adamw_": {"p2d", "m", "v", "master"},
    "adamw_": {"params", "ms", "vs", "masters"},
    "accumulate_columns_": {"acc"},
    "gather_columns": set(),
    "scatter_columns_": {"dst2d"},
}


def _op_samples():
    p, g, idx, m, v, master = _selective_case((9, 12), torch.bfloat16, 4)
    s = dict(decay=0.999, lerp_w=0.1, beta2=0.999, one_minus_beta2=1e-3, eps=1e-8,
             neg_step_size=-0.01, bc2_sqrt=0.05)
    return {
        "column_scores": (g, "l2"),
        "column_scores_add_": (g, "l1", torch.zeros(12, device=DEVICE)),
        "selective_adamw_": (p, g, idx, m, v, master, *s.values()),
        "adamw_": ([p.float()], [g], [m.new_zeros(9, 12)], [m.new_zeros(9, 12)], [None],
                   0.999, 0.1, 0.999, 1e-3, 1e-8, [-0.01], [0.05]),
        "accumulate_columns_": (torch.zeros(9, 4, device=DEVICE), g, idx, 0.5),
        "gather_columns": (p, idx, torch.float32),
        "scatter_columns_": (p, idx, m),
    }


@pytest.mark.parametrize("name", sorted(OPS_MUTATES))
def test_registered_with_torch_library(name):
    from torch._library.triton import triton_ops_to_kernels

    qualname = f"zenflow_triton::{name}"
    op = getattr(torch.ops.zenflow_triton, name).default
    schema = op._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
    assert written == OPS_MUTATES[name], f"{schema}"
    # Registered through torch.library.triton_op (not an opaque custom_op).
    assert qualname in triton_ops_to_kernels
    args = _op_samples()[name]
    if DEVICE == "cuda":
        torch.library.opcheck(op, args)  # schema, fake tensors, AOT dispatch
    else:
        # Under the interpreter the kernel cannot run on FakeTensors (see the compile test),
        # so only the schema check: the declared mutations are exactly the real ones.
        torch.library.opcheck(op, args, test_utils=("test_schema",))


INTERPRETER_COMPILE_REASON = (
    "torch.compile cannot trace Triton kernels under TRITON_INTERPRET=1: @triton.jit then "
    "returns an InterpretedFunction, which torch.library.wrap_triton passes through "
    "unwrapped (torch/_library/triton.py), so Dynamo's FakeTensor propagation of the "
    "triton_op runs the interpreter on FakeTensors and fails with 'Cannot access data "
    "pointer of Tensor'; a GPU (compiled Triton) is needed")


@pytest.mark.skipif(DEVICE != "cuda", reason=INTERPRETER_COMPILE_REASON)
def test_torch_compile_fullgraph():
    p, g, idx, m, v, master = _selective_case((64, 256), torch.bfloat16, 32)

    def step(p, g, idx, m, v, master, lr):
        scores = TRITON_OPS.column_scores(g)
        TRITON_OPS.selective_adamw(p, g, idx, m, v, master, lr=lr, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.1, step=3)
        return scores

    compiled = torch.compile(step, fullgraph=True)
    eager_args, comp_args = _clone([p, g, idx, m, v, master]), _clone([p, g, idx, m, v, master])
    s_e = step(*eager_args, 1e-3)
    s_c = compiled(*comp_args, 1e-3)
    torch.testing.assert_close(s_c, s_e, rtol=1e-6, atol=0)
    for a, b in zip(comp_args, eager_args):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_kernels_import_without_triton():
    # The per-op files import Triton guardedly: without it TORCH_OPS works and the Triton
    # backend reports itself unavailable (ImportError), and launchers raise ImportError.
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes "import triton" raise ImportError
        import torch
        from zenflow_triton.kernels import TORCH_OPS, triton_available
        from zenflow_triton.kernels.column_scores import column_scores
        ok, why = triton_available()
        assert not ok and "unavailable" in why, why
        g = torch.ones(3, 2)
        assert TORCH_OPS.column_scores(g).tolist() == [3.0, 3.0]
        try:
            column_scores(g)
        except ImportError:
            print("OK")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=tree_env())
    assert res.returncode == 0 and res.stdout.strip() == "OK", res.stderr[-2000:]


def test_nonfinite_flags_matches_its_reference():
    """One flag per gradient, whatever its dtype, shape or strides: every NaN and +-inf
    flagged; a finite gradient whose sum of squares overflows may be flagged too, and
    confirm() clears it (fp16 is reduced in fp32, so its largest values do not overflow)."""
    from zenflow_triton.kernels.finite import confirm, nonfinite_flags, nonfinite_flags_ref

    big = torch.finfo(torch.float32).max
    grads = [torch.randn(7, 3), torch.tensor([1.0, float("nan")]),
             torch.tensor([-float("inf"), 2.0]).to(torch.bfloat16),
             torch.full((5,), 60000.0, dtype=torch.float16), torch.tensor([big, -big]),
             torch.randn(6, 4).t(), torch.tensor([[0.0, float("inf")], [1.0, 2.0]]).t(),
             torch.randn(1)]
    flags = nonfinite_flags(grads).tolist()
    exact = nonfinite_flags_ref(grads).tolist()
    assert exact == [False, True, True, False, False, False, True, False]
    assert flags == [False, True, True, False, True, False, True, False]  # [4]: overflow
    assert [f and confirm(g) for f, g in zip(flags, grads)] == exact
    with pytest.raises(ValueError, match="empty"):
        nonfinite_flags([torch.zeros(0)])


# --- multi-tensor: device update + accumulation of many params in one launch -----------------

MULTI_SHAPES = [(1, 1), (7, 1023), (33, 70), (5, 3), (64, 16)]


def _multi_case(dtype, g_dtype=None, seed=0):
    """Params of awkward shapes, each with some device-owned and some host-owned columns
    (one with none of each), distinct Adam steps, strided grads for one of them."""
    items = []
    for j, (rows, cols) in enumerate(MULTI_SHAPES):
        k = [1, cols // 5 or 1, 0, cols, cols // 2][j]
        p, g, idx, m, v, master = _selective_case((rows, cols), dtype, min(k, cols),
                                                  seed=seed + 10 * j)
        if g_dtype is not None:
            g = g.to(g_dtype)
        if j == 4:  # a strided gradient: the transpose of a contiguous one
            g = g.t().contiguous().t()
        keep = torch.ones(cols, dtype=torch.bool, device=p.device)
        keep[idx] = False
        hidx = keep.nonzero().view(-1)
        acc = randn(rows, hidx.numel(), seed=seed + 10 * j + 5) if j != 3 else None
        items.append([p, g, idx, m, v, master, 3 + j, acc, hidx])
    return items


def _run_multi(ops_fn, items):
    cols = list(zip(*items))
    return ops_fn(*cols, **HP)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_selective_adamw_accumulate_multi_equals_per_param_kernels(dtype):
    """One launch for every param, bit for bit what the single-param kernels give (same
    arithmetic), and close to the torch reference as the single-param kernels are."""
    from zenflow_triton.kernels.selective_adamw_multi import (
        selective_adamw_accumulate, selective_adamw_accumulate_ref)

    items = _multi_case(dtype)
    multi, single, ref = ([_clone(it) for it in items] for _ in range(3))
    assert _run_multi(selective_adamw_accumulate, multi) == 1  # one launch in all
    for p, g, idx, m, v, master, step, acc, hidx in single:
        TRITON_OPS.selective_adamw(p, g, idx, m, v, master, step=step, **HP)
        if acc is not None:
            TRITON_OPS.accumulate_columns(acc, g, hidx, 1.0)
    _run_multi(selective_adamw_accumulate_ref, ref)
    for j, (a, b, r) in enumerate(zip(multi, single, ref)):
        for name, x, y, z in zip(("p", "g", "idx", "m", "v", "master", "step", "acc"),
                                 a, b, r):
            if not isinstance(x, torch.Tensor):
                continue
            assert torch.equal(x, y), f"param {j}: {name} differs from the per-param kernel"
            if x.dtype == torch.float32:  # the kernels' bound against the torch reference
                scale = z.abs().max().item() if z.numel() else 0.0
                assert (x - z).abs().max().item() <= 1e-6 * scale + 1e-30 if z.numel() else True


def test_selective_adamw_accumulate_multi_groups_by_dtype_and_checks_input():
    from zenflow_triton.kernels.selective_adamw_multi import selective_adamw_accumulate

    a, b = _multi_case(torch.float32)[:2], _multi_case(torch.bfloat16, seed=1)[:2]
    assert _run_multi(selective_adamw_accumulate, a + b) == 2  # one launch per param dtype
    bad = _multi_case(torch.bfloat16)[:1]
    bad[0][5] = None  # a bf16 param without its fp32 master
    with pytest.raises(ValueError, match="fp32 master"):
        _run_multi(selective_adamw_accumulate, bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_adamw_multi_equals_per_tensor_launches(dtype):
    """The eager multi-tensor launch (one per dtype pair) gives bit for bit what one launch
    per tensor (the registered op's body) gives."""
    from zenflow_triton.kernels.adamw import adamw_multi, adamw_scalars_launch
    from zenflow_triton.kernels.selective_adamw import adamw_scalars

    shapes = [(1,), (1023,), (33, 7), (0,), (2, 3, 4)]
    steps = [1, 2, 5, 1, 1000]
    low = dtype != torch.float32
    ps = [randn(*s, dtype=dtype, seed=i) for i, s in enumerate(shapes)]
    gs = [randn(*s, dtype=dtype, seed=10 + i) for i, s in enumerate(shapes)]
    gs[2] = randn(7, 33, dtype=dtype, seed=12).t()  # strided: copied by both launchers
    ms = [randn(*s, seed=20 + i, scale=0.1) for i, s in enumerate(shapes)]
    vs = [randn(*s, seed=30 + i, scale=0.1).square() for i, s in enumerate(shapes)]
    masters = [p.float() + 1e-3 if low else None for p in ps]
    a, b = ([_clone(x) for x in (ps, gs, ms, vs, masters)] for _ in range(2))
    assert adamw_multi(*a, steps, **HP) == 1
    scal = [adamw_scalars(HP["lr"], HP["beta1"], HP["beta2"], HP["eps"], HP["weight_decay"], s)
            for s in steps]
    adamw_scalars_launch(*b, scal[0]["decay"], scal[0]["lerp_w"], scal[0]["beta2"],
                         scal[0]["one_minus_beta2"], scal[0]["eps"],
                         [s["neg_step_size"] for s in scal], [s["bc2_sqrt"] for s in scal])
    for x, y in zip(a, b):
        for i, (s, t) in enumerate(zip(x, y)):
            assert (s is None and t is None) or torch.equal(s, t), i


def test_adamw_multi_promises_alignment_only_when_the_host_checked_it():
    """The flat multi-tensor AdamW tells Triton its tensors are 16-byte aligned with a
    numel that is a multiple of 8 (``ALIGNED``: 128-bit accesses, which
    ``gpu_compile_check.py`` finds in the PTX) only when every tensor of the launch is: a
    slice at an odd storage offset, or a numel of 33, launches the plain variant; the
    results are the same either way (the interpreter ignores the hint; the reference)."""
    from zenflow_triton.kernels import _launch
    from zenflow_triton.kernels.adamw import adamw_multi, adamw_ref

    from .support.specialisations import recording

    def flag(ps):
        gs = [torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) for p in ps]
        ms = [torch.zeros(p.shape) for p in ps]
        vs = [torch.zeros(p.shape) for p in ps]
        want = [_clone(x) for x in (ps, gs, ms, vs)]
        with recording() as rec:
            adamw_multi(ps, gs, ms, vs, [None] * len(ps), [1] * len(ps), **HP)
        adamw_ref(*want, [None] * len(ps), [1] * len(ps), **HP)
        for x, y in zip((ps, ms, vs), (want[0], want[2], want[3])):
            for s, t in zip(x, y):
                torch.testing.assert_close(s, t, rtol=1e-6, atol=1e-7)
        (_, key), = rec.launches
        return key[0][-1]  # ALIGNED, the last constexpr

    buf = torch.zeros(80)
    assert buf.data_ptr() % _launch.ALIGN_BYTES == 0
    assert flag([torch.randn(64), torch.randn(8, 16)]) == ("constexpr", True)
    assert flag([torch.randn(64), buf[1:17]]) == ("constexpr", False)   # 4 bytes off
    assert flag([torch.randn(64), torch.randn(33)]) == ("constexpr", False)  # 33 elements
    assert _launch.vector_aligned(16, buf[4:20], None) and not _launch.vector_aligned(12, buf)


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_scatter_columns_multi_is_exact(dtype):
    """The apply's scatter for many params in one launch: bit for bit the reference (fp32
    sources cast to the destination's dtype, rounding to nearest even), strided sources."""
    from zenflow_triton.kernels.scatter_multi import (scatter_columns_multi,
                                                      scatter_columns_multi_ref)

    dsts, idxs, srcs = [], [], []
    for j, (rows, cols) in enumerate(MULTI_SHAPES):
        dsts.append(randn(rows, cols, dtype=dtype, seed=j))
        k = [1, cols // 3 or 1, 0, cols, cols // 2][j]
        idxs.append(pick(cols, k, seed=j))
        src = randn(k, rows, seed=10 + j).t()  # fp32, strided
        srcs.append(src)
    a, b = _clone(dsts), _clone(dsts)
    assert scatter_columns_multi(a, idxs, srcs) == 1
    scatter_columns_multi_ref(b, idxs, srcs)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_nonfinite_flags_keeps_the_input_order_across_dtypes():
    from zenflow_triton.kernels.finite import nonfinite_flags

    nan = float("nan")
    grads = [torch.ones(3), torch.tensor([nan]).bfloat16(), torch.tensor([1.0, nan]),
             torch.ones(2).bfloat16(), torch.tensor([float("inf")]).half(), torch.ones(4)]
    assert nonfinite_flags(grads).tolist() == [False, True, True, False, True, False]


def test_multi_tensor_kernels_refuse_int32_indices():
    """Their index tables are read through int64 pointers: an int32 index would be read as
    garbage (it crashed the interpreter), so the launchers refuse it."""
    from zenflow_triton.kernels.scatter_multi import scatter_columns_multi
    from zenflow_triton.kernels.selective_adamw_multi import selective_adamw_accumulate

    dst, src = randn(4, 6), randn(4, 2)
    idx32 = torch.tensor([1, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int64 tensor"):
        scatter_columns_multi([dst], [idx32], [src])
    items = _multi_case(torch.float32)[:1]
    items[0][2] = items[0][2].to(torch.int32)
    with pytest.raises(ValueError, match="int64 tensor"):
        _run_multi(selective_adamw_accumulate, items)


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_bf16_accumulators(g_dtype):
    """accumulator_dtype="bfloat16": the multi-tensor kernel, the single-param kernel and
    torch's ``acc.add_`` agree bit for bit (one fp32 add, correctly rounded everywhere, then
    rounded to nearest even into bf16), and the sum really is kept in bf16."""
    from zenflow_triton.kernels.selective_adamw_multi import (
        selective_adamw_accumulate, selective_adamw_accumulate_ref)

    items = _multi_case(torch.bfloat16, g_dtype=g_dtype)
    for it in items:
        if it[7] is not None:
            it[7] = it[7].to(torch.bfloat16)
    multi, single, ref = ([_clone(it) for it in items] for _ in range(3))
    assert _run_multi(selective_adamw_accumulate, multi) == 1
    for p, g, idx, m, v, master, step, acc, hidx in single:
        if acc is not None:
            TRITON_OPS.accumulate_columns(acc, g, hidx, 1.0)
    _run_multi(selective_adamw_accumulate_ref, ref)
    changed = 0
    for j, (a, b, r, orig) in enumerate(zip(multi, single, ref, items)):
        if a[7] is None:
            continue
        assert a[7].dtype == torch.bfloat16
        assert torch.equal(a[7], b[7]), f"param {j}: multi vs single-param kernel"
        assert torch.equal(a[7], r[7]), f"param {j}: kernel vs torch acc.add_"
        changed += int(not torch.equal(a[7], orig[7]))
    assert changed  # the gradients were really added


def test_multi_kernel_groups_accumulator_dtypes():
    """fp32 and bf16 accumulators in one call: one launch each, and an fp16 accumulator is
    refused by name."""
    from zenflow_triton.kernels.selective_adamw_multi import selective_adamw_accumulate

    a, b = _multi_case(torch.float32)[:2], _multi_case(torch.float32, seed=1)[:2]
    for it in b:
        it[7] = it[7].to(torch.bfloat16)
    assert _run_multi(selective_adamw_accumulate, a + b) == 2
    bad = _multi_case(torch.float32)[1:2]  # host-owned columns to accumulate
    bad[0][7] = bad[0][7].half()
    with pytest.raises(ValueError, match=r"acc\[0\] must be a contiguous fp32 or bf16"):
        _run_multi(selective_adamw_accumulate, bad)
