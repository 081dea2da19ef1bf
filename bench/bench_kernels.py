"""GPU benchmarks of the Triton kernels (pytest-benchmark).

Each benchmark reports achieved bandwidth (useful bytes moved by the op / time) against two
baselines: the device's peak memory bandwidth from its properties (bus width x DDR clock)
and a device-to-device copy measured in the same run. The fused selective AdamW is also
timed against the torch path it replaces (``index_select`` + ``torch._fused_adamw_`` +
``index_copy_``) at topk_ratio in {0.01, 0.05, 0.1, 0.25}; the summary gives the speedup.

Run:  python3 -m pytest bench/bench_kernels.py -q [--benchmark-json=out.json]
A text summary is printed at the end and, when ``ZENFLOW_BENCH_OUT`` names a folder, written
there as ``bench_kernels.txt`` (plus ``bench_kernels_summary.json``).

Without CUDA the benchmarks run only in CPU smoke mode: on CPU, in Triton's interpreter, with
tiny shapes (a check that the benchmark code runs, not a measurement). Smoke mode is on when
``ZENFLOW_BENCH_CPU_SMOKE=1`` or ``ZENFLOW_BENCH_QUICK=1`` is set (the latter is what
``scripts/test.sh``, i.e. CI, sets, so CI keeps this code from rotting; a guard in
``tests/test_bench_smoke.py`` fails if it all gets skipped again). Without CUDA and without
either variable, every benchmark is skipped. With CUDA both variables are ignored: the
benchmarks run at full size.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
CPU_SMOKE = not HAS_CUDA and (os.environ.get("ZENFLOW_BENCH_CPU_SMOKE") == "1"
                              or os.environ.get("ZENFLOW_BENCH_QUICK") == "1")
if CPU_SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs

pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or CPU_SMOKE),
    reason="GPU benchmarks need a CUDA device (torch.cuda.is_available() is False); "
           "set ZENFLOW_BENCH_CPU_SMOKE=1 (or ZENFLOW_BENCH_QUICK=1) to smoke-run them "
           "in the Triton interpreter")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# A Llama-3-8B MLP down-projection: [4096, 14336] bf16. Tiny on the CPU smoke run.
ROWS, COLS = (4096, 14336) if HAS_CUDA else (64, 96)
TOPK_RATIOS = [0.01, 0.05, 0.1, 0.25]
INNER = 20 if HAS_CUDA else 1     # launches per timed round
ROUNDS = 15 if HAS_CUDA else 1
HP = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

_RESULTS: list[dict] = []  # one row per benchmark, for the summary


def _ops():
    from zenflow_triton.kernels import triton_available
    ok, why = triton_available()
    if not ok:
        pytest.skip(why)
    from zenflow_triton.kernels.triton_ops import TRITON_OPS
    return TRITON_OPS


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def peak_bandwidth_gbs() -> float | None:
    """Peak DRAM bandwidth from the device properties (double data rate), GB/s."""
    if DEVICE.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(DEVICE)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * bus_bits / 8 * clock_khz * 1e3 / 1e9


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return f"CPU {platform.processor() or platform.machine()} (Triton interpreter, smoke)"


def _time_per_call(fn) -> float:
    """Seconds per call of ``fn``, by CUDA events over INNER calls (median of ROUNDS)."""
    fn()
    _sync()
    times = []
    for _ in range(ROUNDS):
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(INNER):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / INNER)
        else:
            t0 = time.perf_counter()
            for _ in range(INNER):
                fn()
            times.append((time.perf_counter() - t0) / INNER)
    times.sort()
    return times[len(times) // 2]


def run(benchmark, name: str, fn, nbytes: int, **info) -> float:
    """Benchmark ``fn`` (pytest-benchmark timing + event timing), record GB/s; returns s/call."""

    def rounds():
        for _ in range(INNER):
            fn()
        _sync()

    benchmark.pedantic(rounds, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    sec = _time_per_call(fn)
    gbs = nbytes / sec / 1e9
    peak = peak_bandwidth_gbs()
    row = dict(name=name, us=sec * 1e6, bytes=nbytes, gbs=gbs,
               frac_peak=(gbs / peak) if peak else None, **info)
    copy = next((r for r in _RESULTS if r["name"] == "copy"), None)
    if copy is not None and name != "copy":
        row["frac_copy"] = gbs / copy["gbs"]
    benchmark.extra_info.update(row)
    _RESULTS.append(row)
    return sec


def _el(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _idx(cols: int, ratio: float) -> torch.Tensor:
    k = max(1, round(ratio * cols))
    return torch.randperm(cols, device=DEVICE)[:k].sort().values


# --- baseline: what the memory system does for a plain copy -----------------------------------

def test_copy_baseline(benchmark):
    """Device-to-device copy of the gradient matrix: the achievable-bandwidth baseline
    (runs first: the others report their fraction of it)."""
    src = _rand(ROWS, COLS, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    run(benchmark, "copy", lambda: dst.copy_(src), 2 * src.numel() * src.element_size())


# --- per kernel --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_column_scores(benchmark, dtype):
    ops = _ops()
    g = _rand(ROWS, COLS, dtype=dtype)
    out = torch.zeros(COLS, device=DEVICE)
    nbytes = g.numel() * _el(dtype) + 2 * COLS * 4
    run(benchmark, f"column_scores[{dtype}]", lambda: ops.column_scores(g, "l2", out), nbytes)


def _selective_bytes(rows: int, k: int, p_dtype: torch.dtype, master: bool) -> int:
    # g read; m, v read+write; weight read (master or p) + master write; p write; idx read
    w = 8 if master else _el(p_dtype)
    return rows * k * (_el(p_dtype) + 16 + w + _el(p_dtype)) + 8 * k


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("ratio", TOPK_RATIOS)
def test_selective_adamw(benchmark, ratio, impl):
    """bf16 params with fp32 master: the fused kernel vs index_select + _fused_adamw_ +
    index_copy_ (the same update; bytes counted as the fused kernel's useful traffic)."""
    ops = _ops()
    p = _rand(ROWS, COLS, dtype=torch.bfloat16)
    g = _rand(ROWS, COLS, dtype=torch.bfloat16)
    idx = _idx(COLS, ratio)
    k = idx.numel()
    m = _rand(ROWS, k, scale=1e-3)
    v = _rand(ROWS, k, scale=1e-3).square()
    master = p.index_select(1, idx).float()
    if impl == "triton":
        def fn():
            ops.selective_adamw(p, g, idx, m, v, master, **HP, step=10)
    else:
        step_t = torch.tensor(10.0, device=DEVICE)

        def fn():
            gi = g.index_select(1, idx).float()
            torch._fused_adamw_([master], [gi], [m], [v], [], [step_t], lr=HP["lr"],
                                beta1=HP["beta1"], beta2=HP["beta2"],
                                weight_decay=HP["weight_decay"], eps=HP["eps"],
                                amsgrad=False, maximize=False)
            p.index_copy_(1, idx, master.to(p.dtype))
    run(benchmark, f"selective_adamw[{ratio}-{impl}]", fn,
        _selective_bytes(ROWS, k, torch.bfloat16, master=True), ratio=ratio, impl=impl, k=k)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_adamw(benchmark, impl):
    """The device-owned small params of a 32-layer model: 2 norms of 4096 per layer plus a
    few larger tensors, bf16 with fp32 masters (vs torch._fused_adamw_ on the masters)."""
    ops = _ops()
    n_small = 64 if HAS_CUDA else 3
    hidden = 4096 if HAS_CUDA else 33
    shapes = [(hidden,)] * n_small + [(hidden * 64,)] * (4 if HAS_CUDA else 1)
    ps = [_rand(*s, dtype=torch.bfloat16) for s in shapes]
    gs = [_rand(*s, dtype=torch.bfloat16) for s in shapes]
    ms = [_rand(*s, scale=1e-3) for s in shapes]
    vs = [_rand(*s, scale=1e-3).square() for s in shapes]
    masters = [p.float() for p in ps]
    steps = [10] * len(shapes)
    if impl == "triton":
        def fn():
            ops.adamw(ps, gs, ms, vs, masters, steps, **HP)
    else:
        step_ts = [torch.tensor(10.0, device=DEVICE) for _ in shapes]

        def fn():
            gf = [g.float() for g in gs]
            torch._fused_adamw_(masters, gf, ms, vs, [], step_ts, lr=HP["lr"],
                                beta1=HP["beta1"], beta2=HP["beta2"],
                                weight_decay=HP["weight_decay"], eps=HP["eps"],
                                amsgrad=False, maximize=False)
            torch._foreach_copy_(ps, masters)
    n = sum(math.prod(s) for s in shapes)
    run(benchmark, f"adamw[{impl}]", fn, n * (2 + 16 + 8 + 2), impl=impl,
        tensors=len(shapes))


def test_accumulate_columns(benchmark):
    """Host-owned columns at topk_ratio 0.1: 90% of the columns into an fp32 buffer."""
    ops = _ops()
    g = _rand(ROWS, COLS, dtype=torch.bfloat16)
    idx = _idx(COLS, 0.9)
    acc = torch.zeros(ROWS, idx.numel(), device=DEVICE)
    nbytes = ROWS * idx.numel() * (2 + 8) + 8 * idx.numel()
    run(benchmark, "accumulate_columns", lambda: ops.accumulate_columns(acc, g, idx, 0.25),
        nbytes)


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_gather_scatter_columns(benchmark, op):
    """Migration-sized column moves (10% of the columns): bf16 param <-> fp32 buffer."""
    ops = _ops()
    p = _rand(ROWS, COLS, dtype=torch.bfloat16)
    idx = _idx(COLS, 0.1)
    k = idx.numel()
    src = _rand(ROWS, k)
    nbytes = ROWS * k * (2 + 4) + 8 * k
    if op == "gather":
        fn = lambda: ops.gather_columns(p, idx, torch.float32)  # noqa: E731
    else:
        fn = lambda: ops.scatter_columns(p, idx, src)  # noqa: E731
    run(benchmark, f"{op}_columns", fn, nbytes)


# --- summary -------------------------------------------------------------------------------------

def _summary() -> tuple[str, dict]:
    peak = peak_bandwidth_gbs()
    lines = [f"device: {device_name()}",
             f"torch {torch.__version__}; shape [{ROWS}, {COLS}]",
             f"peak memory bandwidth (properties): "
             f"{f'{peak:.0f} GB/s' if peak else 'unknown'}",
             "",
             f"{'benchmark':<34}{'us/call':>10}{'GB/s':>10}{'of peak':>9}{'of copy':>9}"]
    for r in _RESULTS:
        fp = f"{r['frac_peak']:.0%}" if r.get("frac_peak") else "-"
        fc = f"{r['frac_copy']:.0%}" if r.get("frac_copy") else "-"
        lines.append(f"{r['name']:<34}{r['us']:>10.1f}{r['gbs']:>10.1f}{fp:>9}{fc:>9}")
    speedups = {}
    for ratio in TOPK_RATIOS:
        t = {r["impl"]: r["us"] for r in _RESULTS if r.get("ratio") == ratio and "impl" in r}
        if {"triton", "torch"} <= t.keys():
            speedups[str(ratio)] = t["torch"] / t["triton"]
    a = {r["impl"]: r["us"] for r in _RESULTS if r["name"].startswith("adamw[")}
    if speedups:
        lines += ["", "fused selective AdamW vs torch path (index_select + _fused_adamw_ + "
                      "index_copy_), speedup:"]
        lines += [f"  topk_ratio {k:>5}: {s:.2f}x" for k, s in speedups.items()]
    if {"triton", "torch"} <= a.keys():
        lines.append(f"\nadamw (triton) vs torch._fused_adamw_: {a['torch'] / a['triton']:.2f}x")
    data = dict(device=device_name(), torch=torch.__version__, shape=[ROWS, COLS],
                peak_gbs=peak, results=_RESULTS, selective_speedup=speedups)
    return "\n".join(lines), data


@pytest.fixture(scope="module", autouse=True)
def _write_summary():
    yield
    if not _RESULTS:
        return
    text, data = _summary()
    print("\n" + text)
    out = os.environ.get("ZENFLOW_BENCH_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_kernels.txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "bench_kernels_summary.json"), "w") as f:
            json.dump(data, f, indent=2, default=str)
