"""Data parallelism: DDP on 2 CPU ranks (gloo), spawned by the tests, the host work sharded
by rows (zenflow_triton/shard.py).

Every rank must end with the same params and the same column selection, and those must
follow a single process on the concatenated batch to fp32 rounding (DDP's all-reduce sums
in another order); each rank keeps half the rows of every host half; a full state_dict
saved mid-window resumes bit for bit; a rank whose host worker fails makes every rank fail
with a clear error, within ``host_timeout``.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zenflow_triton import ZenFlowOptimizer

from .support.helpers import assert_trajectories_close, tree_env

WORLD = 2
STEPS = 20
LR = 1e-2
CFG = dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=True,
           min_offload_numel=64, host_threads=1)

# Resume runs: bf16 host moments, so the full form gathers two dtypes (fp32 masters, bf16
# moments) in one call.
RESUME_CFG = dict(CFG, update_interval=4, select_interval=8, host_state_dtype="bfloat16")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16))


def batches(steps: int = STEPS):
    """Inputs whose columns have scales far apart, so the weights' column scores (and the
    selections) are well separated: an all-reduced mean cannot flip a choice. 24 samples a
    batch: they split evenly over 2 and over 3 ranks."""
    g = torch.Generator().manual_seed(1)
    scale = torch.logspace(0, 1.5, 24)[torch.randperm(24, generator=g)]
    return [(torch.randn(24, 24, generator=g) * scale, torch.randn(24, 16, generator=g))
            for _ in range(steps)]


def train(model, opt, data, rank=0, world=1, start=0, stop=None):
    for x, y in data[start:stop]:
        n = x.shape[0] // world
        xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()


def _worker(rank: int, world: int, store: str, scenario: str, out: str) -> None:
    global WORLD, OUT
    WORLD, OUT = world, out  # the scenarios read them
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    result = {}
    try:
        if ":" in scenario:  # another test module's scenario: "module:function"
            import importlib
            module, name = scenario.split(":")
            result = getattr(importlib.import_module(module), name)(rank)
        else:
            result = SCENARIOS[scenario](rank)
    except BaseException as e:
        result = dict(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    finally:
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# The modes a rank could get wrong on its own rows: the host adds each step's columns of
# this rank's rows (accumulate_on="host"), bf16 host moments and accumulators, and a window
# applied at its own boundary (overlap=False).
def _collectives_scenario(rank: int) -> dict:
    """The collective waits of each step (``RowShard._wait``, which every wait on a
    collective of the library goes through), and the host-blocking calls the step counter
    sees, over 8 steps: windows of 2, reselection every 4."""
    from zenflow_triton.dist.shard import RowShard

    from .support.counting import count_step

    waits = []
    real = RowShard._wait

    def counted(self, work, what):
        waits.append(what)
        return real(self, work, what)

    RowShard._wait = counted
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZenFlowOptimizer(model.parameters(), lr=LR, **CFG, fresh_if_spread=False)  # as given
    per_step, syncs = [], []
    try:
        for x, y in batches(8):
            n = x.shape[0] // WORLD
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x[rank * n:(rank + 1) * n]),
                                         y[rank * n:(rank + 1) * n]).backward()
            before = len(waits)
            syncs.append(count_step(opt).kinds())
            per_step.append(waits[before:])
        st = opt.stats()
    finally:
        RowShard._wait = real
        opt.close()
    return dict(per_step=per_step, syncs=syncs, refreshes=st["selection_refreshes"],
                host_updates=st["host_updates"])


MODES = {"host-acc": dict(accumulate_on="host"),
         "bf16-state": dict(host_state_dtype="bfloat16", accumulator_dtype="bfloat16"),
         "sync": dict(overlap=False),
         # The adaptive host step size where its trust cap does not bind (at LR the cap is
         # 1: 0.01 * rms(w) / LR < 1): a multiplier between sqrt(4) and 4 that the moments
         # decide, from every rank's rows.
         "adaptive": dict(update_interval=4, select_interval=8, lr=2e-4),
         # ... with the host moments decayed by beta ** 4 a window (host_step in gradients)
         "adaptive-window": dict(update_interval=4, select_interval=8, lr=2e-4,
                                 host_betas="window"),
         # results applied 1 step after their window: the drain (with its agreement and row
         # gather) at a step that is not a boundary, on every rank alike
         "delay1": dict(update_interval=4, select_interval=8, apply_delay=1)}


def mode_config(mode: str | None) -> tuple[float, dict]:
    """(lr, config fields) of a mode of ``MODES``."""
    cfg = {**CFG, **MODES.get(mode, {})}
    return cfg.pop("lr", LR), cfg


def _train_scenario(rank: int, backend: str = "torch", mode: str | None = None) -> dict:
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    lr, cfg = mode_config(mode)
    opt = ZenFlowOptimizer(model.parameters(), lr=lr, backend=backend, **cfg)
    train(ddp, opt, batches(), rank, WORLD)
    acc_rows = [s["acc"].shape[0] for s in opt.state.values()
                if isinstance(s.get("acc"), torch.Tensor)]
    opt.synchronize()
    st = opt.stats()
    out = dict(params=[p.detach().clone() for p in model.parameters()],
               device_idx=[s["device_idx"].clone() for s in opt.state.values()
                           if "device_idx" in s],
               host_rows=[s["host_master"].shape[0] for s in opt.state.values()
                          if "host_master" in s],
               acc_rows=acc_rows,
               world=st["world_size"], rank=st["rank"], host_updates=st["host_updates"],
               migrated=st["columns_migrated"], multiplier=st["host_lr_multiplier_mean"])
    opt.close()
    return out


def _resumed_vs_uninterrupted(rank: int, checkpoint) -> dict:
    """Train 12 steps (windows of 4) uninterrupted, and again with ``checkpoint(opt, model)``
    at u = 6 (mid-window, a job pending), which returns a new optimizer holding the state
    and anything to report; both runs' final params."""
    cfg = RESUME_CFG
    data = batches(12)

    def run(resume: bool):
        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZenFlowOptimizer(model.parameters(), lr=LR, **cfg)
        extra = None
        if resume:
            train(ddp, opt, data, rank, WORLD, 0, 6)
            opt, extra = checkpoint(opt, model, cfg)
            train(ddp, opt, data, rank, WORLD, 6, None)
        else:
            train(ddp, opt, data, rank, WORLD)
        opt.synchronize()
        opt.close()
        return [p.detach().clone() for p in model.parameters()], extra

    want, _ = run(False)
    got, extra = run(True)
    return dict(want=want, got=got, extra=extra)


def _resume_scenario(rank: int) -> dict:
    """A full state_dict (collective: every rank calls it) through torch.save/load."""
    import io

    def checkpoint(opt, model, cfg):
        buf = io.BytesIO()
        sd = opt.state_dict()
        full_rows = [s["host_master"].shape[0] for s in sd["state"].values()
                     if "host_master" in s]
        torch.save(sd, buf)
        opt.close(finish=False)  # handed over: the new optimizer goes on
        buf.seek(0)
        new = ZenFlowOptimizer(model.parameters(), lr=LR, **cfg)
        new.load_state_dict(torch.load(buf, weights_only=True))
        return new, full_rows

    res = _resumed_vs_uninterrupted(rank, checkpoint)
    return dict(res, full_rows=res["extra"])


def inject_host_failure(rank: int, accumulate_on: str = "device") -> None:
    """From now on, in this process: rank 1's second host job (or, with host accumulation,
    its fourth host add) raises."""
    from zenflow_triton.host import HostAdamW, HostWorker

    if rank == 1:
        calls = []
        if accumulate_on == "device":
            real = HostAdamW.update_many

            def broken(self, tasks):
                calls.append(1)
                if len(calls) == 2:
                    raise ArithmeticError("injected host failure on rank 1")
                return real(self, tasks)
            HostAdamW.update_many = broken
        else:
            real_submit = HostWorker.submit

            def submit(self, fn, label):
                if label.startswith("host accumulation"):
                    calls.append(1)
                    if len(calls) == 4:
                        def fn():
                            raise ArithmeticError("injected host failure on rank 1")
                return real_submit(self, fn, label)
            HostWorker.submit = submit


def _failure_scenario(rank: int, accumulate_on: str = "device") -> dict:
    """Rank 1's second host job (or, with host accumulation, its fourth host add) raises."""
    inject_host_failure(rank, accumulate_on)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZenFlowOptimizer(model.parameters(), lr=LR,
                           **dict(CFG, host_timeout=5.0, accumulate_on=accumulate_on))
    return until_failure(opt, lambda: train(ddp, opt, batches(), rank, WORLD))


def until_failure(opt, run) -> dict:
    """``run()``, then ``opt.synchronize()``: ``error`` (what raised, or None) and the
    ``seconds`` it took; the optimizer closed whatever happened."""
    t0 = time.monotonic()
    try:
        run()
        opt.synchronize()
        return dict(error=None, seconds=time.monotonic() - t0)
    except Exception as e:
        return dict(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    finally:
        try:
            opt.close()
        except Exception:
            pass


def torchrun(args: list[str], timeout: float = 240) -> str:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 *args`` from the
    repository root, CPU only, without the launcher variables of any run around it; its
    output (the run must exit 0)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK",
                                                                      "WORLD_SIZE", "LOCAL_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    # The tree under test first: the children import it, not whatever zenflow_triton is
    # installed (a venv of another checkout would otherwise test that one).
    env["PYTHONPATH"] = tree_env()["PYTHONPATH"]
    for attempt in range(2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc_per_node", "2", *args], cwd=root, env=env,
                              capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
        # --standalone picks a free port and binds it later: another test's rendezvous
        # (pytest -n 2) can take it in between. That race, and only it, gets one more try.
        if proc.returncode == 0 or not _port_taken(out):
            break
    assert proc.returncode == 0, out[-3000:]
    return out


def _port_taken(out: str) -> bool:
    return any(m in out for m in ("Address already in use", "EADDRINUSE",
                                  "address already in use"))


def _dcp_scenario(rank: int) -> dict:
    """save_sharded mid-window (each rank writes its rows), load_sharded into new
    optimizers, go on. Also returns the full form at the save point, for a single process
    to load the same checkpoint against."""
    path = os.path.join(OUT, "dcp")

    def checkpoint(opt, model, cfg):
        opt.save_sharded(path)
        full = opt.state_dict()
        opt.close(finish=False)  # handed over: the new optimizer goes on
        new = ZenFlowOptimizer(model.parameters(), lr=LR, **cfg)
        new.load_sharded(path)
        return new, full

    res = _resumed_vs_uninterrupted(rank, checkpoint)
    return dict(res, full=res["extra"], path=path)


SCENARIOS = {"train": _train_scenario, "resume": _resume_scenario,
             "train-triton": lambda rank: _train_scenario(rank, "triton"),
             **{f"train-{m}": (lambda rank, m=m: _train_scenario(rank, mode=m)) for m in MODES},
             "collectives": _collectives_scenario,
             "failure": _failure_scenario, "dcp": _dcp_scenario,
             "failure-host-acc": lambda rank: _failure_scenario(rank, "host")}


def _one_process(cfg: dict, lr: float = LR):
    """The single-process run on the whole batches: its model, selections and host rows."""
    model = make_model()
    with ZenFlowOptimizer(model.parameters(), lr=lr, **cfg) as opt:
        train(model, opt, batches())
        opt.synchronize()
        idx = [s["device_idx"].clone() for s in opt.state.values() if "device_idx" in s]
        rows = [s["host_master"].shape[0] for s in opt.state.values() if "host_master" in s]
    return model, idx, rows


def spawn(scenario: str, tmp_path, world: int = WORLD) -> list[dict]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(tmp_path / "store"), scenario,
                                               str(tmp_path)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"scenario {scenario}: a rank did not finish within 240 s")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    if not scenario.startswith("failure"):
        for r, res in enumerate(results):
            assert "error" not in res, f"rank {r}: {res.get('trace', res)}"
    return results


@pytest.mark.parametrize("world,backend", [
    (2, "torch"), (2, "triton"),
    pytest.param(3, "torch", marks=pytest.mark.skipif(
        os.environ.get("ZENFLOW_SLOW") != "1", reason="3 ranks: set ZENFLOW_SLOW=1"))])
def test_ranks_agree_and_follow_one_process_on_the_whole_batch(tmp_path, world, backend):
    """The Triton backend runs the accumulation of this rank's rows as an entry of its own
    in the multi-tensor kernel (no device columns, row-sliced views)."""
    from zenflow_triton.kernels import triton_available

    if backend == "triton" and not triton_available()[0]:
        pytest.skip(triton_available()[1])
    ranks = spawn("train" if backend == "torch" else "train-triton", tmp_path, world)
    a = ranks[0]
    assert [r["rank"] for r in ranks] == list(range(world)) and a["world"] == world
    assert a["host_updates"] > 5 and a["migrated"] > 0
    for b in ranks[1:]:
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)  # every rank writes the same rows into the same params
        for x, y in zip(a["device_idx"], b["device_idx"]):
            assert torch.equal(x, y)
    # Each rank keeps its rows of every host half (32 and 16 rows): ceil(rows / world)
    # each, the last rank the rest.
    for r, res in enumerate(ranks):
        assert res["host_rows"] == [min(32, (r + 1) * -(-32 // world)) - min(32, r * -(-32 // world)),
                                    min(16, (r + 1) * -(-16 // world)) - min(16, r * -(-16 // world))]
    assert [sum(res["host_rows"][i] for res in ranks) for i in range(2)] == [32, 16]
    for res in ranks:  # the device accumulators hold this rank's rows only
        assert res["acc_rows"] == res["host_rows"], res["acc_rows"]

    model, single_idx, single_rows = _one_process(CFG)
    assert single_rows == [32, 16]
    for x, y in zip(a["device_idx"], single_idx):
        assert torch.equal(x, y)  # the same selections
    assert_trajectories_close(a["params"], [p.detach() for p in model.parameters()],
                              STEPS, LR * CFG["update_interval"])


def test_full_state_dict_resumes_mid_window_bit_for_bit(tmp_path):
    for r, res in enumerate(spawn("resume", tmp_path)):
        assert res["full_rows"] == [32, 16], r  # the full form: every rank's rows
        for x, y in zip(res["got"], res["want"]):
            assert torch.equal(x, y), r


def test_sharded_checkpoint_resumes_and_loads_into_one_process(tmp_path):
    """save_sharded/load_sharded (torch.distributed.checkpoint): each rank writes its own
    rows; resuming on 2 ranks is bit for bit the uninterrupted run; a single process loads
    the same checkpoint (resharded by DCP) into exactly the full state."""
    ranks = spawn("dcp", tmp_path)
    for r, res in enumerate(ranks):
        for x, y in zip(res["got"], res["want"]):
            assert torch.equal(x, y), r
    files = sorted(f for f in os.listdir(ranks[0]["path"]) if f.endswith(".distcp"))
    assert len(files) == WORLD, files  # one file per rank: no rank wrote it all
    full = ranks[0]["full"]
    model = make_model()
    with ZenFlowOptimizer(model.parameters(), lr=LR,
                          **RESUME_CFG) as opt:
        opt.load_sharded(ranks[0]["path"])
        mine = copy.deepcopy(opt.state_dict())  # (leaving the block finishes: live tensors)
    assert mine["zenflow"]["global_step"] == full["zenflow"]["global_step"] == 6
    for i, st in full["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine["state"][i][key].cpu(), value.cpu()), (i, key)
            else:
                assert mine["state"][i][key] == value, (i, key)


@pytest.mark.parametrize("scenario", ["failure", "failure-host-acc"])
def test_a_failing_rank_fails_every_rank_without_hanging(tmp_path, scenario):
    """A failed host job, or a failed host accumulation (it raises on its own rank at the
    next step; the ranks hear of it at the next apply point): every rank fails, naming it."""
    a, b = spawn(scenario, tmp_path)
    assert b["error"] and "injected host failure on rank 1" in b["error"], b
    assert a["error"] and "rank(s) [1]" in a["error"], a
    assert a["seconds"] < 60 and b["seconds"] < 60, (a, b)


def test_the_ddp_example_runs_under_torchrun():
    """examples/train_ddp.py, as docs/distributed.md shows it, with 2 gloo ranks (torchrun
    --standalone): it trains, prints every rank's host memory and checks that every rank
    holds the same params (exit status 1 if not)."""
    out = torchrun(["examples/train_ddp.py", "--steps", "12"])
    assert "world 2: params identical on every rank: True" in out, out[-3000:]
    assert "rank 1: host state" in out


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_follows_one_process(tmp_path, mode):
    """DDP on 2 ranks against one process on the whole batch, in each mode of ``MODES``:
    the same params on every rank, the same selections as one process, and the one
    process's trajectory to fp32 rounding (bf16 state: plus the bf16 rounding that an
    fp32 difference of the all-reduced gradient can flip, per window). A rank that added,
    kept or wrote the wrong rows would be off by whole updates (0.19 in a run tried on
    purpose with a wrong row offset)."""
    ranks = spawn(f"train-{mode}", tmp_path)
    a, b = ranks
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    if mode == "adaptive":  # the moments, not a bound, decided it: strictly between
        assert 2.0 < a["multiplier"] < 4.0 and a["multiplier"] == b["multiplier"], (a, b)
    lr, cfg = mode_config(mode)
    model, single_idx, _ = _one_process(cfg, lr)
    for x, y in zip(a["device_idx"], single_idx):
        assert torch.equal(x, y)
    want = [p.detach() for p in model.parameters()]
    if mode != "bf16-state":
        assert_trajectories_close(a["params"], want, STEPS, lr * cfg["update_interval"])
        return
    # bf16 accumulators and moments: an fp32-rounding difference of the all-reduced gradient
    # can flip a bf16 rounding (2**-8 relative) of an accumulator or a moment, which moves
    # that window's host update (at most lr_eff * R) by a few such units; summed over the
    # windows (4 units each: the accumulator, m, v and the square root).
    from .support.helpers import adam_step_bound, fp32_run_tol
    lr_eff = LR * CFG["update_interval"]
    windows = STEPS // CFG["update_interval"]
    atol = 4 * 2.0 ** -8 * windows * lr_eff * adam_step_bound(0.9, 0.999, STEPS)
    tol = fp32_run_tol(STEPS, lr_eff)
    for i, (g, w) in enumerate(zip(a["params"], want)):
        torch.testing.assert_close(g, w, rtol=tol["rtol"], atol=tol["atol"] + atol,
                                   msg=lambda m, i=i: f"param {i}: {m}")


def test_collective_waits_per_step(tmp_path):
    """Under DDP the library waits on collectives only at apply points, launches and
    reselections, and an apply waits on one: the all-gather of the results' rows carries
    every rank's vote on whether its host work succeeded (``RowShard.gather_rows(agree=...)``);
    a launch adds the all-reduce of the adaptive step sizes' statistics (every rank's rows).
    Windows of 2, reselection every 4 (steps 1 and 5): steps 3 and 7 wait on none; steps 4
    and 8 apply and launch (two); steps 2 and 6 launch after a reselection and have nothing
    to apply (the vote alone, the statistics: two); step 5 applies and migrates (two: the
    results, the leaving columns' rows); step 1 selects for the first time (the vote, the
    rows). Host reads at an apply and launch: the finite check's, the vote's, the
    statistics'."""
    for res in spawn("collectives", tmp_path):
        assert res["refreshes"] == 2 and res["host_updates"] == 4
        counts = [len(w) for w in res["per_step"]]
        assert counts == [2, 2, 0, 2, 2, 2, 0, 2], res["per_step"]
        for t in (2, 4, 6, 8):
            assert res["per_step"][t - 1][-1].startswith("an all-reduce of the adaptive"), \
                res["per_step"]
        for t in (4, 8):
            assert res["syncs"][t - 1].get(".tolist()") == 3, res["syncs"][t - 1]
            assert "HostWorker.wait" in res["syncs"][t - 1]
