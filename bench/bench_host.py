"""The host half: AdamW throughput, whole-pipeline overhead, link bytes per step.

(1) Host AdamW throughput (G elements/s) on 2^24 and 2^26 fp32 elements and on 100 tensors
    of mixed sizes summing to 2^24: ours (HostAdamW, persistent pool, torch's fused CPU
    kernel per chunk) vs torch.optim.AdamW(fused=True), (foreach=True) and DeepSpeed's
    DeepSpeedCPUAdam (skipped with the reason when deepspeed is not importable). Each is
    also given as a fraction of the memory-bandwidth roofline: AdamW moves 28 bytes per
    element (reads param, grad, m, v; writes param, m, v), and the machine's bandwidth is
    measured in the same run (``test_memory_bandwidth``: the best of ``dst.copy_(src)``, 8
    bytes/element, and ``torch.add(a, b, out=c)``, 12 bytes/element, on 2^26 fp32
    elements, torch's default intra-op threads, median of the rounds; explicit bytes only,
    write-allocate traffic is not counted, for AdamW either).
(1b) Dispatch cost: one update of 100 tensors of 64 elements (the work is nothing, the
    Python and the pool hand-off are everything), ours vs one torch._fused_adamw_ call.
(2) Whole-pipeline cost in ZeRO-Offload mode (topk_ratio=0, update_interval=1,
    overlap=False: every step is a full host update) on a >= 100M-param model on CPU, with
    fixed random grads: step() time and the host job's busy time per step, against a plain
    HostAdamW.update_many over the same elements (same threads). Ratios measured in the
    same run.
(3) Link bytes per step, averaged over 100 steps of a small MLP trained on random data,
    ZeRO-Offload mode vs ZenFlow (topk_ratio=0.1, update_interval=4,
    accumulate_on="device"), in units of the model's param bytes (opt.stats()).

ZENFLOW_BENCH_QUICK=1 shrinks every size so the suite runs in seconds.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time

import pytest
import torch
from torch import nn

import _report
from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.host import HostAdamW, HostHyper
from zenflow_triton.host.adamw import _Pool

QUICK = _report.QUICK
THREADS = max(1, torch.get_num_threads())
BYTES_PER_ELEM = 28
CHUNK = int(os.environ.get("ZENFLOW_BENCH_CHUNK", 1 << 22))
QUIET_S = 0.05

SIZES = {"2^20": [1 << 20], "mixed100_2^20": None} if QUICK else \
    {"2^24": [1 << 24], "2^26": [1 << 26], "mixed100_2^24": None}
ROUNDS = {"2^20": 2, "mixed100_2^20": 2, "2^24": 21, "2^26": 11, "mixed100_2^24": 21}
IMPLS = ["torch_fused", "torch_foreach", "deepspeed_cpu_adam", "zenflow_host"]
BANDWIDTH: dict[str, float] = {}


def mixed_sizes(total: int, n: int = 100, seed: int = 0) -> list[int]:
    """``n`` sizes spanning ~3 decades (log-uniform), summing exactly to ``total``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.rand(n, generator=g, dtype=torch.float64) * 7.0)
    sizes = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
    sizes[sizes.index(max(sizes))] += total - sum(sizes)
    return sizes


def sizes_of(case: str) -> list[int]:
    if SIZES[case] is not None:
        return SIZES[case]
    return mixed_sizes(1 << (20 if QUICK else 24))


def _median_time(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---------------------------------------------------------------------------- (1)

def test_memory_bandwidth(benchmark):
    """The machine's streaming bandwidth, two ways: in-place ``a.add_(b)`` (reads a and b,
    writes a: 12 bytes/element, all of them explicit, the access pattern of AdamW, whose
    writes go to lines it has just read) and ``c.copy_(a)`` (8 explicit bytes/element; the
    write-allocate read of c is not counted, so copy_ understates the bandwidth)."""
    n = 1 << (22 if QUICK else 26)
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    rounds = 3 if QUICK else 9
    copy_s = _median_time(lambda: c.copy_(a), rounds)
    benchmark.pedantic(lambda: a.add_(b), rounds=rounds, iterations=1, warmup_rounds=1)
    add_s = statistics.median(benchmark.stats.stats.data)
    copy_bw, add_bw = 8 * n / copy_s, 12 * n / add_s
    BANDWIDTH["bytes_per_s"] = add_bw
    benchmark.extra_info.update(copy_GBps=copy_bw / 1e9, inplace_add_GBps=add_bw / 1e9)
    roof = add_bw / BYTES_PER_ELEM
    _report.add({"suite": "host", "case": "bandwidth", "copy_GBps": copy_bw / 1e9,
                 "inplace_add_GBps": add_bw / 1e9, "roofline_Gelem_per_s": roof / 1e9},
                f"host  memory bandwidth: in-place add_ {add_bw / 1e9:5.2f} GB/s (12 B/elem), "
                f"copy_ {copy_bw / 1e9:5.2f} GB/s (8 B/elem counted) on 2^{n.bit_length() - 1} "
                f"fp32, {THREADS} torch threads -> AdamW roofline {roof / 1e9:.3f} G elem/s "
                f"at 28 B/elem")


class _Skip(Exception):
    pass


def _buffers(sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """(param, grad, m, v) per size. Every implementation updates these same buffers: where
    in physical memory a buffer lands moved the same kernel's time by up to 10% between two
    copies of the same data on this machine, which separate buffers per implementation would
    have turned into a bias between them."""
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3,
             torch.zeros(n), torch.zeros(n)) for n in sizes]


def _make_impl(impl: str, bufs: list[tuple[torch.Tensor, ...]]):
    """(step function, closer) for one implementation over the shared ``bufs`` (their
    optimizer state is seeded with the shared moments); raises _Skip with the reason where it
    cannot run here."""
    kw = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if impl == "zenflow_host":
        adamw = HostAdamW(THREADS, CHUNK, 600.0)
        count = [0]

        def step():
            count[0] += 1
            h = HostHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, count[0])
            adamw.update_many([(p, gr, m, v, h) for p, gr, m, v in bufs])

        return step, adamw.close
    params = []
    for p, gr, _, _ in bufs:
        params.append(nn.Parameter(p))  # shares p's storage
        params[-1].grad = gr
    if impl == "torch_fused":
        opt = torch.optim.AdamW(params, fused=True, **kw)
    elif impl == "torch_foreach":
        opt = torch.optim.AdamW(params, foreach=True, **kw)
    elif impl == "deepspeed_cpu_adam":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam(params, adamw_mode=True, **kw)
        except Exception as e:  # not installed, or its C++ op does not build here
            raise _Skip(f"deepspeed not importable: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from e
    else:
        raise ValueError(impl)
    for param, (_, _, m, v) in zip(params, bufs):  # the shared moments as the state
        step = 0 if impl == "deepspeed_cpu_adam" else torch.tensor(0.0)
        opt.state[param].update(step=step, exp_avg=m, exp_avg_sq=v)
    return opt.step, lambda: None


@pytest.mark.parametrize("case", list(SIZES))
def test_host_adamw_throughput(benchmark, case):
    """All implementations on the same sizes, interleaved round by round in a shuffled order
    (the machine's load changes over time, and an implementation measurably ran slower right
    after certain others; shuffling keeps the ratios fair). pytest-benchmark times whole
    rounds; each implementation's time inside a round is taken here."""
    sizes = sizes_of(case)
    numel = sum(sizes)
    gc.collect()
    steps, closers, skipped = {}, [], {}
    bufs = _buffers(sizes)
    for impl in IMPLS:
        try:
            steps[impl], close = _make_impl(impl, bufs)
            closers.append(close)
        except _Skip as e:
            skipped[impl] = str(e)
    # The roofline is re-measured in every round, on as many elements as the case: the
    # machine's load (and so its bandwidth) changes over the run.
    # Two probes, the better one counts: torch's own add_ (its OpenMP threads) and add_ in
    # pieces on single-threaded pool workers (as HostAdamW runs; robust to a loaded machine).
    bw_a, bw_b = torch.rand(numel), torch.rand(numel)
    pool = _Pool(THREADS, "bench-bandwidth")
    closers.append(lambda: pool.close(10.0))
    piece = max(1 << 16, numel // (4 * THREADS))

    def pool_add():
        futs = [pool.submit(lambda s: bw_a[s:s + piece].add_(bw_b[s:s + piece]), s)
                for s in range(0, numel, piece)]
        for f in futs:
            f.result(600)

    steps["_bandwidth_torch"] = lambda: bw_a.add_(bw_b)
    steps["_bandwidth_pool"] = pool_add
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    rng = random.Random(0)

    def one_round():
        order = list(times)
        rng.shuffle(order)
        for impl in order:
            time.sleep(QUIET_S)  # every implementation starts from a quiet machine
            t0 = time.perf_counter()
            steps[impl]()
            times[impl].append(time.perf_counter() - t0)

    try:
        one_round()  # warm-up
        for t in times.values():
            t.clear()
        benchmark.pedantic(one_round, rounds=ROUNDS[case], iterations=1, warmup_rounds=0)
    finally:
        for close in closers:
            close()
    bw = 12 * numel / min(statistics.median(times.pop("_bandwidth_torch")),
                          statistics.median(times.pop("_bandwidth_pool")))
    rates = {impl: numel / statistics.median(t) for impl, t in times.items()}
    base, ds = rates.get("torch_fused"), rates.get("deepspeed_cpu_adam")
    benchmark.extra_info.update(elements=numel, tensors=len(sizes), bandwidth_GBps=bw / 1e9,
                                **{f"{k}_Gelem_per_s": r / 1e9 for k, r in rates.items()})
    for impl in IMPLS:
        if impl in skipped:
            _report.add({"suite": "host", "case": case, "impl": impl, "skipped": skipped[impl]},
                        f"host  {case:<14} {impl:<19} skipped: {skipped[impl]}")
            continue
        rate = rates[impl]
        frac = rate * BYTES_PER_ELEM / bw
        vs = f"{rate / base:5.2f}x torch fused" if impl != "torch_fused" else "baseline   "
        if ds and impl not in ("deepspeed_cpu_adam",):
            vs += f", {rate / ds:5.2f}x DeepSpeed"
        _report.add({"suite": "host", "case": case, "impl": impl, "elements": numel,
                     "tensors": len(sizes), "seconds": numel / rate, "Gelem_per_s": rate / 1e9,
                     "roofline_fraction": frac, "ratio_vs_torch_fused": rate / base,
                     "ratio_vs_deepspeed": rate / ds if ds else None},
                    f"host  {case:<14} {impl:<19} {rate / 1e9:6.3f} G elem/s  "
                    f"{frac * 100:5.1f}% of roofline  {vs}")
    _report.add({"suite": "host", "case": case, "impl": "roofline", "bandwidth_GBps": bw / 1e9},
                f"host  {case:<14} roofline            {bw / BYTES_PER_ELEM / 1e9:6.3f} G elem/s"
                f"  (in-place add_ {bw / 1e9:.2f} GB/s in the same rounds, best of torch's "
                f"threads and the pool)")


def test_host_adamw_dispatch_overhead(benchmark):
    n, size = 100, 64
    bufs = _buffers([size] * n)
    adamw = HostAdamW(THREADS, CHUNK, 600.0)
    count = [0]
    torch_times: list[float] = []

    def torch_call():
        steps = [torch.tensor(float(count[0] + 1)) for _ in bufs]
        t0 = time.perf_counter()
        torch._fused_adamw_(*[[b[i] for b in bufs] for i in range(4)], [], steps, lr=1e-4,
                            beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
                            amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        torch_times.append(time.perf_counter() - t0)

    def ours():
        count[0] += 1
        h = HostHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, count[0])
        adamw.update_many([(p, g, m, v, h) for p, g, m, v in bufs])

    try:
        benchmark.pedantic(ours, setup=torch_call, rounds=50 if not QUICK else 5,
                           iterations=1, warmup_rounds=2)
    finally:
        adamw.close()
    ours_s = statistics.median(benchmark.stats.stats.data)
    torch_s = statistics.median(torch_times[2:] or torch_times)
    _report.add({"suite": "host", "case": "dispatch_100x64", "ours_s": ours_s,
                 "torch_fused_s": torch_s, "ratio": ours_s / torch_s},
                f"host  dispatch (100 tensors x {size} elements): ours {ours_s * 1e3:.2f} ms, "
                f"one torch._fused_adamw_ call {torch_s * 1e3:.2f} ms = "
                f"{ours_s / torch_s:.1f}x (Python and pool hand-off per update)")


# ---------------------------------------------------------------------------- (2)

PIPE_WIDTH, PIPE_LAYERS = (512, 4) if QUICK else (4096, 6)  # 6 x 4096^2 = 100.7M params
PIPE_ROUNDS = 3 if QUICK else 7


def _pipeline_model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(PIPE_WIDTH, PIPE_WIDTH) for _ in range(PIPE_LAYERS)])
    model.to(device)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    return model


@pytest.mark.parametrize("device,check_finite", [
    ("cpu", True), ("cpu", False),
    pytest.param("cuda", False, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU")),
], ids=["cpu-check_finite", "cpu-no_check", "cuda"])
def test_pipeline_overhead_zero_offload_mode(benchmark, device, check_finite):
    """step() in ZeRO-Offload mode against a plain HostAdamW over the same elements, both
    measured in this run. On a CPU-only machine the "device" is the same memory, so the
    copies this mode must make (gradient in, param out) are memory passes of their own:
    AdamW moves 28 B/elem; fused into the pieces, the copy-in adds about 0 (the piece stays
    in cache) and the copy-out 8 (write + read-for-ownership), a floor of 36/28 = 1.29x. The
    finite check (check_finite=True, the default) reads every gradient once more (+4). On a
    GPU the copies are DMA transfers on the copy stream, overlapping other pieces' compute."""
    model = _pipeline_model(device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    host_numel = sum(p.numel() for p in params if p.dim() >= 2)

    # Plain host AdamW over the same (host-owned) elements: flat buffers, same threads.
    g = torch.Generator().manual_seed(2)
    bufs = [(p.detach().reshape(-1).clone(), torch.randn(p.numel(), generator=g) * 1e-3,
             torch.zeros(p.numel()), torch.zeros(p.numel())) for p in params if p.dim() >= 2]
    count, plain_times = [0], []
    adamw = HostAdamW(THREADS, CHUNK, 600.0)

    def plain():
        count[0] += 1
        h = HostHyper(1e-4, 0.9, 0.999, 1e-8, 0.01, count[0])
        t0 = time.perf_counter()
        adamw.update_many([(p, gr, m, v, h) for p, gr, m, v in bufs])
        plain_times.append(time.perf_counter() - t0)

    opt = ZenFlowOptimizer(params, lr=1e-4, topk_ratio=0.0, update_interval=1, overlap=False,
                           host_threads=THREADS, chunk_size=CHUNK, check_finite=check_finite)
    opt.step()  # allocate state
    plain()
    plain_times.clear()
    busy: list[float] = []

    def step():  # the host job's own time, per step (stats() counts it when waited for)
        b0 = opt.stats()["host_busy_seconds"]
        opt.step()
        busy.append(opt.stats()["host_busy_seconds"] - b0)

    try:  # interleaved: a plain update (setup, untimed by pytest-benchmark), then a step()
        benchmark.pedantic(step, setup=plain, rounds=PIPE_ROUNDS, iterations=1,
                           warmup_rounds=1)
        st = opt.stats()
    finally:
        opt.close()
        adamw.close()
    step_s = statistics.median(benchmark.stats.stats.data)
    plain_s = statistics.median(plain_times)
    busy_s = statistics.median(busy[1:])  # without the warm-up round
    benchmark.extra_info.update(params=numel, plain_host_adamw_s=plain_s,
                                host_busy_s_per_step=busy_s, step_s=step_s)
    link_bytes = (st["bytes_device_to_host"] + st["bytes_host_to_device"]) / st["steps"]
    floor = (f"memory floor of this mode on one memory {36 / 28:.2f}x, {40 / 28:.2f}x with "
             "the check" if device == "cpu" else
             f"link {link_bytes / 1e9:.2f} GB/step = {link_bytes / step_s / 1e9:.1f} GB/s")
    _report.add({"suite": "host", "case": f"pipeline_zero_offload_{device}_"
                 f"{'check' if check_finite else 'nocheck'}", "device": device,
                 "params": numel, "check_finite": check_finite,
                 "plain_host_adamw_s": plain_s, "host_busy_s_per_step": busy_s,
                 "step_s": step_s, "host_work_overhead": busy_s / plain_s,
                 "step_overhead": step_s / plain_s},
                f"host  pipeline (ZeRO-Offload mode, {device}, check_finite={check_finite}, "
                f"{numel / 1e6:.1f}M params, "
                f"{host_numel / 1e6:.1f}M host-owned): plain HostAdamW {plain_s * 1e3:.1f} ms; "
                f"host job {busy_s * 1e3:.1f} ms/step = {busy_s / plain_s:.3f}x; whole step() "
                f"{step_s * 1e3:.1f} ms = {step_s / plain_s:.3f}x (goal < 1.15x; {floor})")


# ---------------------------------------------------------------------------- (3)

LINK_WIDTH, LINK_LAYERS, LINK_STEPS = (128, 3, 12) if QUICK else (256, 4, 100)

LINK_CASES = {
    "zero_offload_mode": dict(topk_ratio=0.0, update_interval=1, overlap=False),
    "zenflow_k0.1_u4_dev": dict(topk_ratio=0.1, update_interval=4, overlap=True,
                                accumulate_on="device"),
    "zenflow_k0.1_u4_host": dict(topk_ratio=0.1, update_interval=4, overlap=True,
                                 accumulate_on="host"),
}


@pytest.mark.parametrize("case", list(LINK_CASES))
def test_link_bytes_per_step(benchmark, case):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(LINK_LAYERS)
                            for m in (nn.Linear(LINK_WIDTH, LINK_WIDTH), nn.GELU())])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-3, **LINK_CASES[case])
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(32, LINK_WIDTH, generator=g) for _ in range(LINK_STEPS)]

    def run():
        for x in data:
            model.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    benchmark.pedantic(run, rounds=1, iterations=1)
    st = opt.stats()
    opt.close()
    d2h = st["bytes_device_to_host"] / st["steps"] / param_bytes
    h2d = st["bytes_host_to_device"] / st["steps"] / param_bytes
    benchmark.extra_info.update(d2h_per_step=d2h, h2d_per_step=h2d)
    _report.add({"suite": "host", "case": f"link_{case}", "steps": st["steps"],
                 "param_bytes": param_bytes, "d2h_x_param_bytes": d2h,
                 "h2d_x_param_bytes": h2d, "total_x_param_bytes": d2h + h2d},
                f"host  link {case:<21} {d2h + h2d:5.3f}x param bytes/step (d2h {d2h:.3f}, "
                f"h2d {h2d:.3f}) over {st['steps']} steps, "
                f"{param_bytes / 1e6:.2f} MB params")
