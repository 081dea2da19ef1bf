"""The optimizer end to end on a GPU: numbers a CPU run cannot give (run by gpu_check.sh).

On a CUDA device, for a stack of bf16 Linear layers (a Llama-like width), it measures and
writes to ``$OUT/gpu_check.json`` and ``$OUT/gpu_check.txt``:

1. **Trajectory**: ZenFlow with the Triton backend (compiled kernels) against the torch
   backend, topk_ratio > 0, overlapped windows, reselection: the fp32 masters agree to the
   fp32 rounding bound of tests/support/helpers.fp32_run_tol and each bf16 param is its master
   rounded.
2. **Host syncs per step**, counted by CUDA itself (``torch.cuda.set_sync_debug_mode``: a
   warning for every synchronizing call) on a steady step, an applying boundary and a
   reselection, and the library's own count of blocking transfers.
3. **Kernel time vs step time** (torch.profiler over steady windows): the device time of
   each kernel, the step's wall time, and the idle fraction of the device during step().
4. **GB/s per kernel** against the HBM peak from the device's properties, for the
   multi-tensor device-half kernel (useful bytes from the sizes) and torch's fused AdamW
   on the same params as a yardstick measured in the same run.
5. ``torch.cuda.max_memory_allocated`` for ZenFlow and for fused AdamW.
6. **Gradient streaming** on a Llama trained forward and backward: ``stream_grads=True``
   against ``accumulate_on="host"`` (bit for bit alike?), the peak device memory, step time
   and the optimizer's peak of live gradient bytes of each.

``--cpu-smoke`` runs the same code on CPU tensors with tiny sizes in Triton's interpreter
(the CUDA-only measurements reported as absent): a test (tests/test_bench_smoke.py) runs
it so this script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SYNC_WARNING = "synchroniz"  # torch's message: "called a synchronizing CUDA operation"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny sizes on CPU in the Triton interpreter: checks the code runs")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    return ap.parse_args()


def build(width: int, layers: int, device, dtype=torch.bfloat16, seed: int = 0):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=False), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*mods).to(device=device, dtype=dtype)


def grads_for(model, step: int, device):
    """Seeded gradients (the same on every backend), per-column scales so the column scores
    are far apart and both backends pick the same columns."""
    g = torch.Generator(device=device).manual_seed(1000 + step)  # made on the device: fast
    out = []
    for p in model.parameters():
        x = torch.randn(p.shape, generator=g, device=device)
        if p.dim() == 2:
            cs = torch.Generator(device="cpu").manual_seed(7 + p.shape[1])
            x = x * torch.exp(torch.randn(p.shape[1], generator=cs)).to(device)
        out.append(x.to(dtype=p.dtype))
    return out


def set_grads(model, grads) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g


ZF = dict(lr=1e-3, weight_decay=0.01, topk_ratio=0.1, update_interval=4, select_interval=8,
          overlap=True)


def trajectory(width, layers, device, steps=12) -> dict:
    from tests.support.helpers import fp32_masters, fp32_run_tol
    from zenflow_triton import ZenFlowOptimizer

    runs = {}
    for backend in ("triton", "torch"):
        model = build(width, layers, device)
        with ZenFlowOptimizer(model.parameters(), backend=backend, **ZF) as opt:
            assert opt.backend == backend
            for t in range(steps):
                set_grads(model, grads_for(model, t, device))
                opt.step()
            opt.synchronize()
            runs[backend] = (fp32_masters(opt, list(model.parameters())),
                             [p.detach().cpu() for p in model.parameters()], opt.stats())
    (m_tri, p_tri, s_tri), (m_ref, _, s_ref) = runs["triton"], runs["torch"]
    tol = fp32_run_tol(steps, ZF["lr"] * ZF["update_interval"])
    worst = 0.0
    for a, b in zip(m_tri, m_ref):
        worst = max(worst, ((a - b).abs() / (tol["atol"] + tol["rtol"] * b.abs())).max().item())
    rounded = all(torch.equal(p, m.to(p.dtype)) for p, m in zip(p_tri, m_tri))
    return dict(steps=steps, worst_diff_over_bound=worst, within_bound=worst <= 1.0,
                params_are_rounded_masters=rounded,
                columns_migrated=(s_tri["columns_migrated"], s_ref["columns_migrated"]),
                ok=worst <= 1.0 and rounded
                and s_tri["columns_migrated"] == s_ref["columns_migrated"] > 0)


def syncs_per_step(width, layers, device) -> dict:
    """Steps 1..9 with ZF: 6 is steady, 8 applies a window, 9 reselects."""
    from zenflow_triton import ZenFlowOptimizer

    model = build(width, layers, device)
    cuda = device.type == "cuda"
    out = {}
    me = threading.get_ident()
    with ZenFlowOptimizer(model.parameters(), backend="triton", **ZF) as opt:
        for t in range(1, 10):
            set_grads(model, grads_for(model, t, device))
            if cuda:
                torch.cuda.synchronize()
            blocking0 = opt.link.blocking_transfers
            caught: list[str] = []
            # Sync debug mode and warnings are process-wide: keep the warnings this thread
            # raised (the host worker's own blocking copies never stall the training stream).
            real_show = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if threading.get_ident() == me and SYNC_WARNING in str(message):
                    caught.append(f"{filename}:{lineno}: {str(message)[:120]}")

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    opt.step()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning = real_show
            syncs = caught
            if t in (6, 8, 9):
                out[{6: "steady", 8: "apply", 9: "reselect"}[t]] = dict(
                    cuda_sync_warnings=len(syncs) if cuda else None,
                    blocking_transfers=opt.link.blocking_transfers - blocking0,
                    first_warnings=syncs[:5])
    return out


def profile_steps(width, layers, device, windows=3) -> dict:
    """Kernel time vs step time over steady windows, and GB/s of the device-half kernel."""
    from zenflow_triton import ZenFlowOptimizer

    if device.type != "cuda":
        return dict(skipped="needs CUDA")
    from torch.profiler import ProfilerActivity, profile

    model = build(width, layers, device)
    ui = ZF["update_interval"]
    with ZenFlowOptimizer(model.parameters(), backend="triton", **ZF) as opt:
        grads = grads_for(model, 0, device)
        for _ in range(2 * ui):  # warm-up: selection, compile, one applied window
            set_grads(model, grads)
            opt.step()
        torch.cuda.synchronize()
        walls = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(windows * ui):
                set_grads(model, grads)
                t0 = time.perf_counter()
                opt.step()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
        stats = opt.stats()
    kernels = {}
    for evt in prof.key_averages():
        # Self time: an op's row also holds its kernels' time, which have rows of their own.
        dev_us = (getattr(evt, "self_device_time_total", None)
                  or getattr(evt, "self_cuda_time_total", 0))
        if dev_us and evt.count:
            kernels[evt.key[:80]] = dict(calls=evt.count, device_ms=dev_us / 1e3)
    n_steps = windows * ui
    kernel_ms = sum(k["device_ms"] for k in kernels.values()) / n_steps
    step_ms = 1e3 * sum(walls) / n_steps
    # Useful bytes of the device-half kernel per step (bf16 params and grads): device-owned
    # elements read g (2), master, m, v (12) and write master, m, v, p (14); host-owned
    # elements read g (2) and read+write the fp32 accumulator (8).
    elems = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    dev_frac = ZF["topk_ratio"]
    useful = elems * (dev_frac * 28 + (1 - dev_frac) * 10)
    multi = [k for k in kernels if "selective_adamw_accumulate" in k]
    multi_ms = (sum(kernels[k]["device_ms"] for k in multi) / n_steps) if multi else None
    props = torch.cuda.get_device_properties(device)
    peak = hbm_peak_gbs(props)
    return dict(step_ms_median=1e3 * statistics.median(walls), step_ms_mean=step_ms,
                kernel_ms_per_step=kernel_ms,
                device_idle_fraction=max(0.0, 1 - kernel_ms / step_ms) if step_ms else None,
                device_half_kernel_ms=multi_ms,
                device_half_gbs=useful / (multi_ms * 1e6) if multi_ms else None,
                hbm_peak_gbs=peak, host_updates=stats["host_updates"],
                top_kernels=dict(sorted(kernels.items(),
                                        key=lambda kv: -kv[1]["device_ms"])[:12]))


def hbm_peak_gbs(props) -> float | None:
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # DDR: two transfers per clock


def memory_and_speed(width, layers, device, steps=8) -> dict:
    """Peak device memory and median step time: ZenFlow vs torch.optim.AdamW(fused=True)."""
    from zenflow_triton import ZenFlowOptimizer

    if device.type != "cuda":
        return dict(skipped="needs CUDA")
    out = {}
    makers = {"adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
              "zenflow": lambda ps: ZenFlowOptimizer(ps, backend="triton", **ZF)}
    for name, make in makers.items():
        torch.cuda.empty_cache()
        model = build(width, layers, device)
        grads = grads_for(model, 0, device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        opt = make(model.parameters())
        times = []
        for _ in range(steps):
            set_grads(model, grads)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = dict(step_ms_median=1e3 * statistics.median(times[2:]),
                         peak_optimizer_bytes=torch.cuda.max_memory_allocated(device) - base)
        if hasattr(opt, "stats"):
            out[name]["stats"] = {k: v for k, v in opt.stats().items()
                                  if isinstance(v, (int, float, str))}
        if hasattr(opt, "close"):
            opt.close()
        del opt, model, grads
    return out


def streaming(width, layers, device, steps=6) -> dict:
    """A Llama (random weights, from a config: transformers) trained with forward and
    backward, ``accumulate_on="host"`` against ``stream_grads=True``: whether the params end
    bit for bit alike, ``torch.cuda.max_memory_allocated`` of each run, the median step time
    (forward + backward + step) and the optimizer's own peak of live gradient bytes."""
    try:
        import transformers
    except ImportError:
        return dict(skipped="needs transformers")
    from zenflow_triton import ZenFlowOptimizer

    cuda = device.type == "cuda"
    cfg = transformers.LlamaConfig(vocab_size=32000 if cuda else 128, hidden_size=width // 2,
                                   intermediate_size=int(width * 1.375), num_hidden_layers=layers,
                                   num_attention_heads=max(1, width // 256),
                                   num_key_value_heads=max(1, width // 1024),
                                   max_position_embeddings=512, tie_word_embeddings=False)
    tokens = (4, 256) if cuda else (2, 8)
    out = {"params": None}
    finals = {}
    for name, extra in (("host_accumulation", {}), ("stream_grads", dict(stream_grads=True))):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-4, backend="triton",
                               topk_ratio=0.1, update_interval=2, select_interval=4,
                               accumulate_on="host", dense_params=(), **extra)
        g = torch.Generator(device="cpu").manual_seed(1)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            ids = torch.randint(0, cfg.vocab_size, tokens, generator=g).to(device)
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        opt.finish()
        finals[name] = [p.detach().clone() for p in model.parameters()]
        out[name] = dict(step_ms_median=1e3 * statistics.median(times[1:]),
                         max_memory_allocated=(torch.cuda.max_memory_allocated(device)
                                               if cuda else None),
                         grad_bytes_peak=opt.stats()["grad_bytes_peak"])
        opt.close()
        del opt, model
    a, b = finals["host_accumulation"], finals["stream_grads"]
    out["bit_for_bit"] = all(torch.equal(x, y) for x, y in zip(a, b))
    out["max_abs_diff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    return out


def write(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    lines = [f"{k}: {json.dumps(v, default=str)}" for k, v in report.items()]
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")


def main() -> int:
    args = parse()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, width, layers = torch.device("cpu"), 64, 2
    else:
        if not torch.cuda.is_available():
            print("gpu_check.py needs a CUDA device (or --cpu-smoke)", file=sys.stderr)
            return 2
        device, width, layers = torch.device("cuda"), 4096, 8
    report = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, width=width, layers=layers, zenflow=ZF)
    ok = True
    for name, fn in (("trajectory", trajectory), ("streaming", streaming),
                     ("syncs", syncs_per_step),
                     ("profile", profile_steps), ("memory_and_speed", memory_and_speed)):
        t0 = time.perf_counter()
        try:
            report[name] = fn(width, layers, device)
        except Exception as e:  # report it and go on: the other figures still count
            report[name] = dict(error=f"{type(e).__name__}: {e}")
            ok = False
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(report[name], default=str)[:2000]}", flush=True)
        write(out, report)  # after every section: a timeout keeps what was measured
    ok = ok and report["trajectory"].get("ok", False) and \
        report["streaming"].get("bit_for_bit", True) is not False
    report["ok"] = ok
    write(out, report)
    print("gpu_check.py:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
