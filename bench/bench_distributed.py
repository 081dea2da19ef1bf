"""Data parallelism: host work per window boundary and host memory per rank, by world size.

    python bench/bench_distributed.py                 # world sizes 1 and 2, CPU (gloo)
    python bench/bench_distributed.py --worlds 1 2 --matrices 8 --size 1024 --steps 17

Each world size runs its own ranks (spawned here, gloo, CPU) on the same model (``matrices``
fp32 matrices of ``size`` x ``size``, ZenFlow defaults ``topk_ratio=0.1,
update_interval=4``, fixed gradients: the all-reduce of DDP is not what is measured) with the
machine's cores split between the ranks' host pools. Per world size it reports, from each
rank's ``stats()``: the host and device state bytes per rank, the host job's busy time per boundary
(median over the ranks of ``host_busy_seconds / host_updates``), the bytes one rank moves
down the link per step, and the whole step time. Ratios are against world size 1 in the
same run. On a machine with few cores little time is gained (the ranks share the cores);
the memory per rank is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, store: str, out: str, args: dict) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    from zenflow_triton import ZenFlowOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args["size"], args["size"]) * 0.02)
              for _ in range(args["matrices"])]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
    threads = max(1, args["cores"] // world)
    opt = ZenFlowOptimizer(params, lr=1e-4, topk_ratio=0.1, update_interval=4,
                           host_threads=threads, overlap=False)
    step_s = []
    for _ in range(args["steps"]):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
    opt.synchronize()
    st = opt.stats()
    opt.close()
    with open(os.path.join(out, f"w{world}r{rank}.json"), "w") as f:
        json.dump(dict(world=world, rank=rank, host_state_bytes=st["host_state_bytes"],
                       device_state_bytes=st["device_state_bytes"],
                       host_busy_s=st["host_busy_seconds"], host_updates=st["host_updates"],
                       d2h_per_step=st["bytes_device_to_host"] / st["steps"],
                       step_s=statistics.median(step_s[4:]),
                       params=sum(p.numel() for p in params)), f)
    if world > 1:
        dist.destroy_process_group()


def run_world(world: int, args: dict, tmp: str) -> list[dict]:
    store = os.path.join(tmp, f"store{world}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, store, tmp, args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
        if p.exitcode != 0:
            raise RuntimeError(f"world {world}: a rank exited with {p.exitcode}")
    rows = []
    for r in range(world):
        with open(os.path.join(tmp, f"w{world}r{r}.json")) as f:
            rows.append(json.load(f))
    return rows


def measure(args: dict) -> dict[int, list[dict]]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args["worlds"]:
            results[world] = run_world(world, args, tmp)
    return results


def table(results: dict[int, list[dict]], args: dict) -> list[str]:
    base = results[args["worlds"][0]]
    base_mem = statistics.median(r["host_state_bytes"] for r in base)
    base_busy = statistics.median(r["host_busy_s"] / max(1, r["host_updates"]) for r in base)
    n = base[0]["params"]
    lines = [f"{args['matrices']} fp32 matrices of {args['size']}^2 ({n / 1e6:.1f}M params), "
             f"topk_ratio=0.1, update_interval=4, {args['cores']} cores split over the ranks",
             "| world | host B/param per rank | vs world 1 | device B/param per rank "
             "| host job per boundary (ms) | vs world 1 | link down B/param/step per rank "
             "| step (ms, median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for world, rows in results.items():
        mem = statistics.median(r["host_state_bytes"] for r in rows)
        busy = statistics.median(r["host_busy_s"] / max(1, r["host_updates"]) for r in rows)
        d2h = statistics.median(r["d2h_per_step"] for r in rows)
        step = statistics.median(r["step_s"] for r in rows)
        dev = statistics.median(r["device_state_bytes"] for r in rows)
        lines.append(f"| {world} | {mem / n:.2f} | {mem / base_mem:.2f}x | {dev / n:.2f} | "
                     f"{busy * 1e3:.1f} | "
                     f"{busy / base_busy:.2f}x | {d2h / n:.3f} | {step * 1e3:.1f} |")
    return lines


def test_host_memory_and_work_by_world_size(benchmark):
    """Under pytest-benchmark (CI's bench step, small in quick mode): world sizes 1 and 2."""
    import _report

    args = dict(worlds=[1, 2], matrices=2 if _report.QUICK else 8,
                size=512 if _report.QUICK else 1024, steps=9 if _report.QUICK else 17,
                cores=os.cpu_count() or 1)
    results = benchmark.pedantic(measure, args=(args,), rounds=1, iterations=1)
    lines = table(results, args)
    mem = {w: statistics.median(r["host_state_bytes"] for r in rows)
           for w, rows in results.items()}
    benchmark.extra_info.update(host_bytes_per_rank={str(w): m for w, m in mem.items()})
    for line in lines[3:]:
        _report.add({"suite": "distributed", "line": line}, f"ddp   {line}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--matrices", type=int, default=8)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=17)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    args = vars(ap.parse_args(argv))
    print("\n".join(table(measure(args), args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
