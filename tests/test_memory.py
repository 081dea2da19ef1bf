"""Memory: the bytes the optimizer holds on each side, per element of the model's params.

A model of 16 bf16 matrices of 1024 x 1024 (so the per-worker scratch, 2 x 2 MiB, is small
against it), 9 steps, ``update_interval=4`` unless said otherwise; ``stats()`` counts every
tensor the optimizer holds (state, accumulators, staging, outboxes, scratch, bounce
buffers), each storage once. On a CPU-only run "device" is the params' side, by role.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer

MODES = {
    "zero-offload": dict(topk_ratio=0.0, update_interval=1, overlap=False),
    "host-acc": dict(topk_ratio=0.1, update_interval=4, accumulate_on="host"),
    "defaults": dict(topk_ratio=0.1, update_interval=4),
}


def model16():
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(1024, 1024, bias=False)
                                for _ in range(16)]).to(torch.bfloat16)


def train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        opt.step()


@functools.lru_cache(maxsize=None)
def per_param(mode: str) -> dict[str, float]:
    model = model16()
    n = sum(p.numel() for p in model.parameters())
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, **MODES[mode]) as opt:
        train(model, opt, 9)
        st = opt.stats()
    return {k: st[k] / n for k in ("device_state_bytes", "host_state_bytes",
                                   "host_pinned_bytes")}


def test_zero_offload_mode_holds_nothing_on_the_device():
    """No window accumulator in ZeRO-Offload mode (one-step windows hand the gradient over
    as it is): only the index copies stay on the device."""
    b = per_param("zero-offload")
    assert b["device_state_bytes"] <= 0.1, b
    assert b["host_state_bytes"] <= 12.5, b  # master, m, v (12 B) and the workers' scratch


def test_host_accumulation_is_the_low_device_memory_mode():
    """topk_ratio=0.1, accumulate_on="host": the device holds the device-owned state only
    (fp32 master, m and v of 10% of the columns: 1.2 B/param)."""
    b = per_param("host-acc")
    assert b["device_state_bytes"] <= 1.5, b


def test_defaults():
    """Device: the fp32 accumulator of 90% of the columns (3.6 B) plus the device-owned state
    (1.2 B). Host: master, m and v of 90% of the columns (10.8 B), the bf16 window mean
    staged in the outbox that carries the result back (1.8 B), the workers' scratch."""
    b = per_param("defaults")
    assert b["device_state_bytes"] <= 5.0, b
    assert b["host_state_bytes"] <= 13.0, b
    # Pinned (where CUDA exists): only what crosses the link, not master, m or v.
    assert b["host_pinned_bytes"] <= 2.5, b


@pytest.mark.parametrize("mode", list(MODES))
def test_stats_count_every_state_tensor(mode):
    """The reported bytes are at least what the state dicts hold, side by side: a tensor the
    count missed would show here."""
    from zenflow_triton.state import state_side

    model = model16()
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, **MODES[mode]) as opt:
        train(model, opt, 6)  # mid-window: an accumulator is open (except ZeRO mode)
        st = opt.stats()
        held = {"device": 0, "host": 0}
        for state in opt.state.values():
            for key, t in state.items():
                if isinstance(t, torch.Tensor):
                    held[state_side(key, opt.config.accumulate_on)] += (
                        t.numel() * t.element_size())
    assert st["device_state_bytes"] >= held["device"]
    assert (held["device"] > 0) == (mode != "zero-offload")  # ZeRO mode: empty device half
    assert st["host_state_bytes"] >= held["host"] + st["host_staging_bytes"] - 1
    assert held["host"] > 0


def test_accumulator_only_while_a_window_accumulates():
    """Not before the first selection, not in warm-up (plain AdamW steps hand the gradient
    over as it is), made by the first step that accumulates, dropped by a reselection."""
    model = model16()[:2]
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4,
                          select_interval=8, warmup_steps=2) as opt:
        train(model, opt, 2)  # warm-up
        assert all(s["acc"] is None for s in opt.state.values())
        train(model, opt, 1)  # u = 1: the first selection, and the window opens
        assert all(s["acc"] is not None for s in opt.state.values())
        train(model, opt, 7)  # u = 8: a boundary; u = 9 reselects and the window reopens
        assert all(s["acc"] is not None for s in opt.state.values())


def test_load_state_dict_allocates_only_the_device_owned_state():
    """A checkpoint taken with no open window loads into a new optimizer without any device
    accumulator (the next accumulating step makes it), and host state is never put on the
    device side; the device bytes are the device-owned state's."""
    model = model16()[:4]
    n = sum(p.numel() for p in model.parameters())
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.1,
                          update_interval=4) as opt:
        train(model, opt, 6)
        open_window = opt.stats()["device_state_bytes"] / n
        train(model, opt, 2)  # u = 8: the window closed at the boundary, acc_count = 0
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.1,
                          update_interval=4) as new:
        new.load_state_dict(sd)
        loaded = new.stats()["device_state_bytes"] / n
        assert all(s["acc"] is None for s in new.state.values())
        train(model, new, 1, seed=1)  # the next window opens: its accumulator is made
        reopened = new.stats()["device_state_bytes"] / n
    assert open_window > 4.5  # the accumulator (3.6 B) was there in the saving run
    assert loaded <= 1.3, loaded  # device-owned fp32 master, m, v of 10%: 1.2 B
    assert reopened > 4.5, reopened


def test_memory_table_script_runs():
    """bench/memory_table.py (the table of docs/memory.md) runs and orders its rows as the modes say
    (on a small model, where the workers' fixed scratch dominates the host side: the device
    side only): a bf16 accumulator shrinks the device side, host accumulation more."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "memory_table.py"
    spec = importlib.util.spec_from_file_location("memory_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = {}
    for line in mod.table(n=2, size=128).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = [float(c) for c in cells[1:]]
    assert len(rows) == len(mod.MODES) + 1
    default = rows["defaults (`topk_ratio=0.1, update_interval=4`)"]
    assert rows["defaults, `accumulator_dtype=\"bfloat16\"`"][0] < default[0]
    assert rows["`accumulate_on=\"host\"`"][0] < rows[
        "defaults, `accumulator_dtype=\"bfloat16\"`"][0]
    assert all(r[1] > 0 for label, r in rows.items() if "ZeRO" in label)
    assert rows["`torch.optim.AdamW`, mixed precision (fp32 master, m, v)"][0] == 12.0


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
@pytest.mark.parametrize("host_dtype,acc_dtype", [("float32", "float32"),
                                                  ("bfloat16", "float32"),
                                                  ("float32", "bfloat16"),
                                                  ("bfloat16", "bfloat16")])
def test_host_state_and_accumulator_dtypes(host_dtype, acc_dtype, accumulate_on):
    """``host_state_dtype`` is the dtype of the host moments ``host_m``/``host_v`` held in
    ``opt.state[p]`` (the host master stays fp32), ``accumulator_dtype`` that of the window
    accumulator ``acc`` on whichever side accumulates: mid-window, after a reselection moved
    columns (which rebuilds the host state), and after a state dict round trip. Host moments
    silently kept in fp32 (or an fp32 accumulator) fail here."""
    want_m, want_acc = getattr(torch, host_dtype), getattr(torch, acc_dtype)
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(256, 256, bias=False)
                                 for _ in range(3)]).to(torch.bfloat16)
    cfg = dict(lr=1e-3, topk_ratio=0.1, update_interval=4, select_interval=8,
               host_state_dtype=host_dtype, accumulator_dtype=acc_dtype,
               accumulate_on=accumulate_on)

    def check(opt, when: str) -> None:
        assert opt.state, when
        for p, st in opt.state.items():
            for key in ("host_m", "host_v"):
                assert st[key].dtype == want_m, (when, key, st[key].dtype)
                assert st[key].device.type == "cpu", (when, key)
                assert st[key].numel() > 0, (when, key)
            assert st["host_master"].dtype == torch.float32, when
            assert st["acc"] is not None, when  # mid-window: the accumulator is open
            assert st["acc"].dtype == want_acc, (when, st["acc"].dtype)
            assert st["acc"].shape == st["host_master"].shape, when
            if accumulate_on == "host":
                assert st["acc"].device.type == "cpu", when

    with ZenFlowOptimizer(model.parameters(), **cfg) as opt:
        train(model, opt, 6)  # u = 6: the window of steps 5..8 holds two gradients
        check(opt, "mid-window")
        train(model, opt, 4, seed=1)  # u = 9 reselects (columns migrate), u = 10 accumulates
        assert opt.stats()["columns_migrated"] > 0
        check(opt, "after a reselection")
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    with ZenFlowOptimizer(model.parameters(), **cfg) as new:
        new.load_state_dict(sd)
        check(new, "loaded")
