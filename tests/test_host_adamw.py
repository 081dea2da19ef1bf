"""HostAdamW: torch.optim.AdamW's numbers, bit-identical whatever the threads and chunk size,
batched updates, bounded waits, failures that raise."""

from __future__ import annotations

import os
import time

import pytest
import torch

import zenflow_triton.host.adamw as host_adamw
from zenflow_triton.adamw_math import adamw_
from zenflow_triton.host import HostAdamW, HostHyper, PieceIO

from .support.helpers import assert_trajectories_close, fp32_run_tol

# Sizes around the vector width (8 / 16), ALIGN (64) and MIN_PIECE (65536).
SIZES = [1, 7, 63, 64, 65, 1023, 4097]


def buffers(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 1e-2
    v = torch.rand(n, generator=g) * 1e-4
    return [master, m, v]


def grads(n: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 1, (1,), generator=g).item()
            for _ in range(steps)]


def hyper(step: int, **kw) -> HostHyper:
    base = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    base.update(kw)
    return HostHyper(step=step, **base)


def run_host(adamw: HostAdamW, n: int, steps: int = 4, **kw) -> list[torch.Tensor]:
    master, m, v = buffers(n)
    for t, g in enumerate(grads(n, steps), start=1):
        adamw.update(master, g.clone(), m, v, hyper(t, **kw))
    return [master, m, v]


def run_torch(n: int, steps: int = 4, **kw) -> list[torch.Tensor]:
    """torch.optim.AdamW (single-tensor path) from the same weights and moments: the outside
    oracle for both of HostAdamW's kernels."""
    master, m, v = buffers(n)
    h = hyper(1, **kw)
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps,
                            weight_decay=h.weight_decay, foreach=False)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    for g in grads(n, steps):
        p.grad = g.clone()
        opt.step()
    st = opt.state[p]
    return [p.detach(), st["exp_avg"], st["exp_avg_sq"]]


def assert_adamw_close(got, want, steps: int, lr: float, n: int) -> None:
    """Two AdamW implementations: weights to fp32_run_tol; the moments to the same relative
    bound, plus an absolute one for cancellation in m's lerp (|m| ~ |g| terms)."""
    g_max = max(g.abs().max().item() for g in grads(n, steps))
    rel = fp32_run_tol(steps, lr)["rtol"]
    assert_trajectories_close(got[:1], want[:1], steps, lr, what="weights")
    torch.testing.assert_close(got[1], want[1], rtol=rel, atol=rel * g_max)
    torch.testing.assert_close(got[2], want[2], rtol=rel, atol=rel * g_max ** 2)


def run_one_call(n: int, steps: int = 4) -> list[torch.Tensor]:
    """The fused kernel on each whole tensor at once, in this thread (no chunks at all)."""
    master, m, v = buffers(n)
    for t, g in enumerate(grads(n, steps), start=1):
        host_adamw._fused_call([[master], [g.clone()], [m], [v]], [t], hyper(t))
    return [master, m, v]


@pytest.fixture
def host():
    made = []

    def make(threads=2, chunk_size=1 << 22, timeout=30.0, **kw):
        h = HostAdamW(threads, chunk_size, timeout, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("kw", [{}, dict(weight_decay=0.0), dict(lr=0.0),
                                dict(beta1=0.5, beta2=0.9, eps=1e-6)],
                         ids=["default", "no-wd", "lr0", "betas"])
def test_matches_torch_optim_adamw(host, kernel, kw):
    """Both kernels ("auto" is torch's fused CPU AdamW where torch has it) against
    torch.optim.AdamW itself, chunked over two threads, from non-zero moments."""
    adamw = host(threads=2, chunk_size=97, kernel=kernel)
    assert adamw.kernel == ("fused" if kernel == "auto" and host_adamw._fused_available()
                            else "reference")
    for n in SIZES:
        assert_adamw_close(run_host(adamw, n, **kw), run_torch(n, **kw), 4,
                           kw.get("lr", 3e-3), n)


@pytest.mark.skipif(not host_adamw._fused_available(), reason="no fused CPU AdamW in torch")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("chunk_size", [1, 7, 97, 4096, 1 << 20])
def test_bit_identical_whatever_threads_and_chunk_size(host, threads, chunk_size):
    adamw = host(threads=threads, chunk_size=chunk_size)
    assert adamw.kernel == "fused"
    for n in (63, 4097, 20_003) if chunk_size < 64 else (63, 4097, 20_003, 140_001):
        got = run_host(adamw, n, steps=2)
        want = run_one_call(n, steps=2)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (n, threads, chunk_size)


def test_chunk_size_is_aligned(host):
    assert host(chunk_size=1).piece_max == host_adamw.ALIGN
    assert host(chunk_size=97).piece_max == 64
    assert host(chunk_size=4096).piece_max == 4096
    assert host(chunk_size=4100).piece_max == 4096


def test_update_many_equals_separate_updates(host):
    """Tasks with their own hyperparameters and steps, small ones packed into shared calls,
    give exactly what one update per task gives."""
    sizes = [5, 64, 1000, 1, 70_001, 333, 4096]
    hypers = [hyper(1 + i % 3, lr=1e-3 * (1 + i % 2), weight_decay=0.1 * (i % 2))
              for i in range(len(sizes))]
    a = [buffers(n, seed=i) for i, n in enumerate(sizes)]
    b = [[t.clone() for t in bufs] for bufs in a]
    gs = [grads(n, 1, seed=10 + i)[0] for i, n in enumerate(sizes)]
    batched = host(threads=2, chunk_size=1000)
    batched.update_many([(bufs[0], g.clone(), bufs[1], bufs[2], h)
                         for bufs, g, h in zip(a, gs, hypers)])
    single = host(threads=1, chunk_size=1 << 22)
    for bufs, g, h in zip(b, gs, hypers):
        single.update(bufs[0], g.clone(), bufs[1], bufs[2], h)
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            assert torch.equal(s, t)


def _streamed(grad_src: torch.Tensor, out: torch.Tensor, master: torch.Tensor, log: list):
    """A PieceIO that loads from ``grad_src`` and stores ``master`` into ``out``, logging."""
    def load(s, e, buf):
        log.append(("load", s, e))
        buf.copy_(grad_src[s:e])

    def store(s, e):
        log.append(("store", s, e))
        out[s:e].copy_(master[s:e])
    return PieceIO(load, store)


@pytest.mark.skipif(not host_adamw._fused_available(), reason="no fused CPU AdamW in torch")
@pytest.mark.parametrize("threads,chunk_size", [(1, 1 << 22), (2, 97), (3, 4096),
                                                (2, 1 << 20)])
def test_piece_io_streams_the_same_numbers(host, threads, chunk_size):
    """A gradient loaded piece by piece into the workers' scratch, and the master stored piece
    by piece, give exactly the plain update; every element is loaded and stored once, and
    each store comes after its piece's kernel call (it sees the new master)."""
    adamw = host(threads=threads, chunk_size=chunk_size)
    sizes = [5, 64, 70_001, 333, 1_300_007]  # the last spans several STREAM_PIECE pieces
    a = [buffers(n, seed=i) for i, n in enumerate(sizes)]
    b = [[t.clone() for t in bufs] for bufs in a]
    gs = [grads(n, 1, seed=10 + i)[0] for i, n in enumerate(sizes)]
    h = HostHyper(3e-3, 0.9, 0.999, 1e-8, 0.1, 3, grad_divisor=3.0)
    outs = [torch.full((n,), float("nan")) for n in sizes]
    logs: list[list] = [[] for _ in sizes]
    srcs = [g.clone() for g in gs]
    adamw.update_many([(bufs[0], None, bufs[1], bufs[2], h, _streamed(src, out, bufs[0], log))
                       for bufs, src, out, log in zip(a, srcs, outs, logs)])
    host(threads=1).update_many([(bufs[0], g.clone(), bufs[1], bufs[2], h)
                                 for bufs, g in zip(b, gs)])
    for x, y, out, src, g, log, n in zip(a, b, outs, srcs, gs, logs, sizes):
        for s_, t in zip(x, y):
            assert torch.equal(s_, t)
        assert torch.equal(out, x[0])  # stored after the update
        assert torch.equal(src, g)  # the source is read, never divided in place
        for kind in ("load", "store"):
            spans = sorted((s_, e) for k, s_, e in log if k == kind)
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(e0 == s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))
            assert all(s_ % host_adamw.ALIGN == 0 for s_, _ in spans)
            assert all(e - s_ <= host_adamw.STREAM_PIECE for s_, e in spans)


def test_piece_io_scratch_is_bounded_by_the_piece(host):
    adamw = host(threads=2, chunk_size=4096)
    n = 1_000_000
    master, m, v = buffers(n)
    src = grads(n, 1)[0]
    adamw.update_many([(master, None, m, v, hyper(1),
                        PieceIO(lambda s, e, out: out.copy_(src[s:e]), None))])
    # one batch per worker at a time: at most max(chunk_size, MIN_PIECE) elements, plus
    # alignment, each; never the tensor's 1M elements
    bound = 2 * 4 * (max(4096, host_adamw.MIN_PIECE) + host_adamw.ALIGN * 16)
    assert 0 < adamw.scratch_bytes() <= bound


def test_piece_io_failures_are_named(host):
    adamw = host(threads=2, chunk_size=64)
    master, m, v = buffers(1000)

    def bad_load(s, e, out):
        raise OSError("injected copy-in failure")

    with pytest.raises(OSError, match="injected copy-in failure"):
        adamw.update_many([(master, None, m, v, hyper(1), PieceIO(bad_load, None))])
    with pytest.raises(ValueError, match="grad=None exactly when io.load"):
        adamw.update_many([(master, None, m, v, hyper(1))])
    with pytest.raises(ValueError, match="grad=None exactly when io.load"):
        adamw.update_many([(master, torch.zeros(1000), m, v, hyper(1),
                            PieceIO(lambda s, e, o: None, None))])
    with pytest.raises(TypeError, match="io must be a PieceIO"):
        adamw.update_many([(master, torch.zeros(1000), m, v, hyper(1), object())])


def test_grad_divisor_is_the_window_mean(host):
    adamw = host(threads=2, chunk_size=1000)
    n = 10_007
    a, b = buffers(n), buffers(n)
    g = grads(n, 1)[0] * 4
    g_a, g_b = g.clone(), g.clone()
    adamw.update(a[0], g_a, a[1], a[2], HostHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 2, 4.0))
    adamw.update(b[0], g_b.div_(4), b[1], b[2], hyper(2, lr=1e-3))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.equal(g_a, g_b)  # the grad holds the mean afterwards, as div_ leaves it


def test_2d_and_empty_tasks(host):
    adamw = host()
    master, m, v = (t.view(7, 11) for t in buffers(77))
    ref = [t.clone() for t in (master, m, v)]
    g = torch.randn(7, 11)
    adamw.update_many([(master, g.clone(), m, v, hyper(1)),
                       (torch.empty(0), torch.empty(0), torch.empty(0), torch.empty(0),
                        hyper(1))])
    adamw_(ref[0], g.clone(), ref[1], ref[2], lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8,
           weight_decay=0.1, step=1)
    tol = fp32_run_tol(1, 3e-3)
    for x, y in zip((master, m, v), ref):  # two implementations when the kernel is fused
        torch.testing.assert_close(x, y, rtol=tol["rtol"], atol=tol["atol"])
    adamw.update_many([])


def test_workers_do_not_change_torch_threads(host):
    before = torch.get_num_threads()
    adamw = host(threads=2)
    run_host(adamw, 70_001, steps=1)
    assert torch.get_num_threads() == before
    if torch.backends.openmp.is_available() and host_adamw._openmp() is not None:
        assert adamw.workers_single_threaded


@pytest.mark.parametrize("bad,match", [
    (lambda b: (b[0].double(), b[1], b[2], b[3]), "master must be fp32"),
    (lambda b: (b[0], b[1][:-1], b[2], b[3]), "grad has 99 elements"),
    (lambda b: (b[0].view(10, 10).t(), b[1].view(10, 10), b[2].view(10, 10),
                b[3].view(10, 10)), "master must be contiguous"),
])
def test_bad_inputs_are_named(host, bad, match):
    adamw = host()
    bufs = [torch.zeros(100) for _ in range(4)]
    with pytest.raises((TypeError, ValueError), match=match):
        adamw.update(*bad(bufs), hyper(1))
    for step in (0, 0.5, float("nan"), True):
        with pytest.raises(ValueError, match="step must be a number >= 1"):
            adamw.update(*bufs, hyper(step))
    with pytest.raises(ValueError, match="threads must be"):
        HostAdamW(0, 10, 1.0)


def test_failing_piece_raises_its_error(host, monkeypatch):
    adamw = host(threads=2, chunk_size=64)
    real = host_adamw._fused_call if adamw.kernel == "fused" else host_adamw._reference_call
    calls = []

    def flaky(lists, steps, h):
        calls.append(1)
        if len(calls) == 3:
            raise ArithmeticError("injected piece failure")
        real(lists, steps, h)

    monkeypatch.setattr(host_adamw, "_fused_call", flaky)
    monkeypatch.setattr(host_adamw, "_reference_call", flaky)
    master, m, v = buffers(100_000)
    t0 = time.monotonic()
    with pytest.raises(ArithmeticError, match="injected piece failure") as info:
        adamw.update(master, torch.randn(100_000), m, v, hyper(1))
    assert time.monotonic() - t0 < 10
    if hasattr(info.value, "__notes__"):
        assert "task 0, elements" in info.value.__notes__[0]
    monkeypatch.undo()
    run_host(adamw, 1000, steps=1)  # the pool survives a failed piece


def test_stuck_piece_times_out(host, monkeypatch):
    adamw = host(threads=2, chunk_size=64, timeout=0.3)
    monkeypatch.setattr(host_adamw, "_fused_call", lambda *a: time.sleep(2))
    monkeypatch.setattr(host_adamw, "_reference_call", lambda *a: time.sleep(2))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=0.3"):
        adamw.update(*[torch.zeros(1000) for _ in range(4)], hyper(1))
    assert time.monotonic() - t0 < 1.5


def test_close_is_idempotent_and_final():
    adamw = HostAdamW(2, 64, 5.0)
    run_host(adamw, 500, steps=1)
    adamw.close()
    adamw.close()
    with pytest.raises(RuntimeError, match="closed"):
        adamw.update(*[torch.zeros(3) for _ in range(4)], hyper(1))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux thread affinity")
def test_host_cores_pin_the_pool_threads_and_never_fail():
    first = min(os.sched_getaffinity(0))
    adamw = HostAdamW(2, 1 << 10, 10.0, cores=(first,))
    try:
        assert all(adamw._pool.pinned)
        for t in adamw._pool._threads:
            assert os.sched_getaffinity(t.native_id) == {first}
        assert os.sched_getaffinity(0) != {first} or len(os.sched_getaffinity(0)) == 1
    finally:
        adamw.close()
    with pytest.warns(RuntimeWarning, match="none of these cores"):
        bad = HostAdamW(1, 1 << 10, 10.0, cores=(100_000,))
        # the warning is raised in the worker thread; wait until it has started
        deadline = time.monotonic() + 5
        while not bad._pool.single_threaded[0] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not any(bad._pool.pinned)
    g = torch.randn(300)
    p, m, v = torch.randn(300), torch.zeros(300), torch.zeros(300)
    bad.update(p, g, m, v, HostHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))  # still computes
    assert torch.isfinite(p).all()
    bad.close()


def test_host_cores_config_validation():
    from zenflow_triton import ConfigError, ZenFlowConfig
    assert ZenFlowConfig(host_cores=[1, 0]).host_cores == (1, 0)
    for bad in ([], [-1], "0,1", [0.5], [True]):
        with pytest.raises(ConfigError, match="host_cores"):
            ZenFlowConfig(host_cores=bad)


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("threads,chunk_size", [(1, 1 << 22), (2, 1000), (3, 64)])
def test_bf16_moments_are_the_fp32_update_rounded(host, kernel, threads, chunk_size):
    """m and v in bf16: each step widens them (exactly), runs the same fp32 update and rounds
    them to nearest once, bit for bit, whatever the threads and pieces; the master stays
    fp32. A streamed gradient (PieceIO) gives the same numbers."""
    n, steps = 3001, 4
    master, m, v = buffers(n)
    m16, v16 = m.to(torch.bfloat16), v.to(torch.bfloat16)
    want_master = master.clone()
    got_master = master.clone()
    a = host(threads, chunk_size, kernel=kernel)
    ref = host(1, 1 << 22, kernel=kernel)
    gm, gv = m16.clone(), v16.clone()
    sm, sv, s_master = m16.clone(), v16.clone(), master.clone()
    for t, g in enumerate(grads(n, steps), start=1):
        wm, wv = m16.float(), v16.float()
        ref.update(want_master, g.clone(), wm, wv, hyper(t))
        m16, v16 = wm.to(torch.bfloat16), wv.to(torch.bfloat16)
        a.update(got_master, g.clone(), gm, gv, hyper(t))
        a.update_many([(s_master, None, sm, sv, hyper(t),
                        PieceIO(lambda s, e, out, g=g: out.copy_(g[s:e]), None))])
        assert gm.dtype == torch.bfloat16 and gv.dtype == torch.bfloat16
        assert torch.equal(got_master, want_master) and torch.equal(s_master, want_master)
        assert torch.equal(gm, m16) and torch.equal(gv, v16)
        assert torch.equal(sm, m16) and torch.equal(sv, v16)
    assert a.moment_scratch_bytes() > 0


def test_moments_must_share_a_supported_dtype(host):
    master, m, v = buffers(10)
    with pytest.raises(TypeError, match="m and v must both be one of"):
        host().update(master, torch.ones(10), m.half(), v.half(), hyper(1))
    with pytest.raises(TypeError, match="m and v must both be one of"):
        host().update(master, torch.ones(10), m.to(torch.bfloat16), v, hyper(1))
