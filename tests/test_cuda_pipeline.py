"""The host job's device copies on CUDA: ordered after what was queued before the launch,
never behind what the training loop queues later; and the optimizer on CUDA params following
the same run on the CPU. Skipped without a GPU (bench/gpu_check.sh runs them); the CPU runs
of the same logic (synchronous copies) are in test_equivalence and test_stress."""

from __future__ import annotations

import time

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.transfer import Link, host_empty

from .support.helpers import (GradFeed, assert_trajectories_close, fp32_masters, make_model,
                              param_groups)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP_CYCLES = int(2e9)  # torch.cuda._sleep: about a second of GPU time at ~2 GHz


def test_copy_waits_for_work_queued_before_the_launch():
    dev = torch.device("cuda")
    n = 1 << 20
    src = torch.zeros(n, device=dev)
    dst = host_empty((n,))  # pinned allocation may synchronize: before the queued work
    link = Link()
    link.copy_queue([dev], timeout=60.0)  # creates the copy stream
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES // 10)  # the training loop's kernels, still running...
    src.fill_(1.0)  # ...and the gradient they produce, queued behind them
    queue = link.copy_queue([dev], timeout=60.0)
    queue.copy(dst, src)
    assert bool((dst == 1.0).all()), "the copy read the gradient before it was written"


def test_copy_does_not_wait_for_work_queued_after_the_launch():
    dev = torch.device("cuda")
    n = 1 << 20
    src = torch.ones(n, device=dev)
    dst = host_empty((n,))
    torch.cuda.synchronize()
    queue = Link().copy_queue([dev], timeout=60.0)
    torch.cuda._sleep(SLEEP_CYCLES)  # the next step's kernels, queued after the launch
    queue.copy(dst, src)
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    still_busy = time.perf_counter() - t0
    assert bool((dst == 1.0).all())
    assert still_busy > 0.05, "the copy waited for kernels queued after the launch"


def _run(device, dtype, steps=12, **cfg):
    model = make_model(dtype=dtype).to(device)
    # The feed's seeded noise (MixedModel has FeedModel's shapes): per-column scales keep
    # the column scores apart, so both devices make the same selection.
    grads = GradFeed(steps, seed=5, pull=0.0, grid=dtype).noise
    with ZenFlowOptimizer(param_groups(model), backend="torch", min_offload_numel=64,
                          host_threads=2, chunk_size=97, **cfg) as opt:
        for step_grads in grads:
            for p, gr in zip(model.parameters(), step_grads):
                p.grad = gr.to(device=device, dtype=dtype)
            opt.step()
        opt.synchronize()
        stats = opt.stats()
        masters = fp32_masters(opt, list(model.parameters()))
    return [p.detach().cpu() for p in model.parameters()], masters, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.0, update_interval=1, overlap=False),  # streamed, the job stores
    dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap=True),  # staged
    dict(topk_ratio=0.2, update_interval=2, select_interval=4, overlap=True,
         accumulate_on="host"),
], ids=["zero-offload", "overlap", "host-acc"])
def test_cuda_params_follow_the_cpu_run(cfg, dtype):
    got, got_m, got_stats = _run("cuda", dtype, **cfg)
    want, want_m, want_stats = _run("cpu", dtype, **cfg)
    # Two implementations (CUDA and CPU kernels): the fp32 masters agree to fp32 rounding
    # over the run, and each param is its own master rounded to its dtype.
    assert_trajectories_close(got_m, want_m, 12, 3e-3 * cfg["update_interval"],
                              what="fp32 master")
    for p, m in zip(got, got_m):
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))
    for key in ("bytes_device_to_host", "bytes_host_to_device", "host_updates"):
        assert got_stats[key] == want_stats[key], key


def test_state_moved_by_a_framework_is_put_back():
    """Lightning moves every optimizer state tensor to the param's device after loading a
    checkpoint (and to the CPU at teardown): the host half must go back to host memory
    (else it fills the GPU and the host AdamW refuses it) and the run go on unchanged."""
    def move_state(opt, device):  # what lightning.fabric's _optimizer_to_device does
        for st in opt.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = v.to(device)

    def run(move: bool):
        model = make_model(dtype=torch.bfloat16).to("cuda")
        feed = GradFeed(10, seed=3, pull=0.0, grid=torch.bfloat16).noise
        with ZenFlowOptimizer(param_groups(model), min_offload_numel=64, topk_ratio=0.2,
                              update_interval=2, select_interval=4) as opt:
            for t, grads in enumerate(feed):
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.to(device="cuda", dtype=torch.bfloat16)
                opt.step()
                if move and t == 4:
                    opt.load_state_dict(opt.state_dict())
                    move_state(opt, torch.device("cuda"))
                    assert any(st["host_master"].is_cuda for st in opt.state.values()
                               if "host_master" in st)
            opt.synchronize()
            assert all(st["host_master"].device.type == "cpu" for st in opt.state.values()
                       if "host_master" in st)
            return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("slowed", ["copy-in", "apply", "host-accumulation"])
def test_slow_copies_do_not_block_the_training_thread(slowed, monkeypatch):
    """Queue about 0.2 s of GPU sleep on a copy stream before each copy the pipeline puts
    there: the window's copy-in (device-to-host), the apply's outbox copy (host-to-device),
    or, with accumulate_on="host", each step's host-owned columns (device-to-host). The
    training loop spends 0.3 s of host time per step (its forward and backward), so no
    step() needs to wait for a copy on the host: each returns within 0.1 s once the first
    window is past (pinned buffers allocated), and the run is bit for bit the unslowed one."""
    cycles = SLEEP_CYCLES // 5
    # No reselection after the first (u = 1): it reads the picks back, a blocking copy that
    # waits for the slowed apply queued before it, by design.
    cfg = dict(topk_ratio=0.2, update_interval=2, select_interval=16, overlap=True,
               accumulate_on="host" if slowed == "host-accumulation" else "device")

    def sleep_on(link, device, direction):
        with torch.cuda.stream(link._stream(device, direction)):
            torch.cuda._sleep(cycles)

    calls = []
    if slowed == "copy-in":
        real_copy_in = Link.copy_in

        def copy_in(self, pairs):
            for dev in {src.device for _, src, *_ in pairs if src.is_cuda}:
                calls.append(dev)
                sleep_on(self, dev, "d2h")
            return real_copy_in(self, pairs)
        patch = ("copy_in", copy_in)
    elif slowed == "apply":
        real_up = Link.to_device_async

        def to_device_async(self, src, device):
            calls.append(device)
            sleep_on(self, torch.device(device), "h2d")
            return real_up(self, src, device)
        patch = ("to_device_async", to_device_async)
    else:
        real_down = Link.to_host_async

        def to_host_async(self, src):
            calls.append(src.device)
            sleep_on(self, src.device, "d2h")
            return real_down(self, src)
        patch = ("to_host_async", to_host_async)

    def run(slow: bool):
        if slow:
            monkeypatch.setattr(Link, *patch)
        model = make_model(dtype=torch.bfloat16).to("cuda")
        feed = [[g.to(device="cuda", dtype=torch.bfloat16) for g in grads]  # uploaded now:
                for grads in GradFeed(10, seed=3, pull=0.0, grid=torch.bfloat16).noise]
        times = []  # a blocking upload in the loop would wait for the slowed streams
        with ZenFlowOptimizer(param_groups(model), min_offload_numel=64, backend="torch",
                              **cfg) as opt:
            for grads in feed:
                for p, g in zip(model.parameters(), grads):
                    p.grad = g.clone()
                if slow:
                    time.sleep(0.3)  # the step's forward and backward on the host
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            opt.synchronize()
        monkeypatch.undo()
        return [p.detach().cpu() for p in model.parameters()], times

    want, _ = run(False)
    got, times = run(True)
    assert calls, "the slowed copy was never made"
    late = times[2 * cfg["update_interval"]:]
    assert max(late) < 0.1, f"step() host times {[round(t, 3) for t in times]}"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.0, update_interval=1, overlap=False),
    dict(topk_ratio=0.1, update_interval=4, accumulate_on="host"),
    dict(topk_ratio=0.1, update_interval=4),
], ids=["zero-offload", "host-acc", "defaults"])
def test_reported_device_bytes_are_what_cuda_allocated(cfg):
    """stats()["device_state_bytes"] against torch.cuda.memory_allocated: the optimizer's
    share of the allocation after 9 steps (model and grads subtracted, copies finished) is
    what it reports, within 2 MiB (allocator rounding, the index tables of a launch). Host
    state is pageable and every link buffer the optimizer reports as such is pinned."""
    from zenflow_triton.state import state_side

    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(1024, 1024, bias=False)
                                 for _ in range(8)]).to(device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(p.shape, device="cuda").to(p.dtype) * 1e-2
             for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, backend="torch", **cfg) as opt:
        for _ in range(9):
            opt.step()
        opt.synchronize()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        st = opt.stats()
        for state in opt.state.values():
            for key, t in state.items():
                if isinstance(t, torch.Tensor) and state_side(key, opt.config.accumulate_on) \
                        == "host":
                    assert t.device.type == "cpu" and not t.is_pinned(), key
    assert abs(held - st["device_state_bytes"]) <= 2 * 2**20, (held, st["device_state_bytes"])


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_cuda_copy_in_mean_is_true_division(dst_dtype):
    """On CUDA, dividing by a Python number multiplies by its reciprocal (1 ulp off the
    quotient on a good share of elements); the copy-in must give the host's fp32 quotient,
    rounded once, as the streamed path and the CPU run do."""
    gen = torch.Generator().manual_seed(0)
    total = torch.randn(1 << 16, generator=gen) * 3
    for n in (3, 5, 7):
        want = (total / n).to(dst_dtype)
        dst = host_empty((1 << 16,), dst_dtype)
        src = total.to("cuda")
        copy_in = Link().copy_in([(dst, src, True, float(n))])
        copy_in.wait_on_host(timeout=60.0)
        assert torch.equal(dst, want), n
        assert not src.any().item()
