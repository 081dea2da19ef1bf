"""GPU discipline, counted on CPU (tests/counting.py): a step's host syncs do not grow with
the number of params, and on the Triton backend neither do its launches.

A model of N Linear(32, 32) layers: N matrices and N biases, every matrix split between
device- and host-owned columns. Counted at a steady step, at a window boundary whose
host result is applied, at a reselection (which also applies) and at warm-up steps, for
N = 4 and 16, exactly on CPU. The counter itself is guarded at the end: each kind of
blocking call it knows, made from library code, is counted once, and an extra blocking copy
per param is caught.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.kernels import triton_available

from .support.counting import BLOCKING_LINK, count_step

SIZES = (4, 16)
# Windows of 2, reselection every 4: t = 3 is steady; t = 4 a boundary that applies the window
# of t = 2 (overlap) or its own (overlap=False); t = 5 (u - 1 = 4) a reselection.
STEADY, APPLY, RESELECT = 3, 4, 5
BACKENDS = ["torch"] + (["triton"] if triton_available()[0] else [])
# On a GPU machine (bench/gpu_check.sh) the same counts on CUDA tensors, kernels compiled.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def idle(opt) -> None:
    """Wait until the host worker has run every job handed to it so far (a no-op job after
    them: jobs run in order). Before each step, so that what the step finds finished does
    not depend on timing: ``HostPipeline.check`` waits on each finished host accumulation
    (to raise its error), so it makes one wait per accumulation of the step before."""
    assert opt._worker.submit(lambda: None, "test: idle").done.wait(60)


@functools.lru_cache(maxsize=None)
def run_counting(n_layers: int, backend: str, dtype=torch.float32, overlap=True,
                 accumulate_on="device", check_finite_at="step", apply_delay=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(n_layers)]).to(
        device=DEVICE, dtype=dtype)
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2,
                           select_interval=4, min_offload_numel=64, backend=backend,
                           overlap=overlap, accumulate_on=accumulate_on,
                           check_finite_at=check_finite_at, apply_delay=apply_delay,
                           fresh_if_spread=False)  # the schedule as given (random data: spread)
    gen = torch.Generator().manual_seed(1)
    counts = {}
    try:
        for t in range(1, RESELECT + 1):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen).to(device=DEVICE, dtype=dtype)
            idle(opt)
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


CONFIGS = {"overlap": dict(overlap=True), "sync": dict(overlap=False),
           "overlap-bf16": dict(overlap=True, dtype=torch.bfloat16),
           "host-acc-bf16": dict(overlap=True, dtype=torch.bfloat16, accumulate_on="host"),
           # The check read where the host waits anyway (the default on CUDA with Triton).
           "overlap-deferred": dict(overlap=True, check_finite_at="boundary"),
           "sync-deferred": dict(overlap=False, check_finite_at="boundary"),
           # the result of the window of t = 2 applied at the end of t = 3, not at t = 4
           "overlap-delay1": dict(overlap=True, apply_delay=1)}
DEFERRED = {"overlap-deferred", "sync-deferred"}  # Triton only: its kernels read the flag
# The host-blocking calls of each counted step, by kind (StepCounts.kinds()), as the code
# does them today on CPU, the same for 4 and 16 matrices and for both backends:
FINITE = {".tolist()": 1}  # the finite check: one flag vector read (inputs.check_finite)
# A reselection brings the check's flags in the copy of its picks: no read of its own.
EXPECTED = {
    "overlap": {
        STEADY: {**FINITE, "HostWorker.wait_event": 1},
        APPLY: {**FINITE, "HostWorker.wait": 1},
        RESELECT: {"HostWorker.wait_event": 1, "HostWorker.wait": 1, BLOCKING_LINK: 2},
    },
    "sync": {
        STEADY: dict(FINITE),
        APPLY: {**FINITE, "HostWorker.wait": 1},
        RESELECT: {BLOCKING_LINK: 2},
    },
    "host-acc-bf16": {
        STEADY: {**FINITE, "HostWorker.wait": 1},
        APPLY: {**FINITE, "HostWorker.wait": 2},
        RESELECT: {"HostWorker.wait": 2, BLOCKING_LINK: 2},
    },
}
EXPECTED["overlap-bf16"] = EXPECTED["overlap"]
# Deferred: a steady step reads no flag; the others read every flag since in one read.
EXPECTED["overlap-deferred"] = {**EXPECTED["overlap"],
                                STEADY: {"HostWorker.wait_event": 1}}
EXPECTED["sync-deferred"] = {**EXPECTED["sync"], STEADY: {}}
# apply_delay=1: the job's wait moves from the boundary (t = 4) to the step after the window
# (t = 3, otherwise steady); nothing is added.
EXPECTED["overlap-delay1"] = {**EXPECTED["overlap"],
                              STEADY: {**FINITE, "HostWorker.wait_event": 1,
                                       "HostWorker.wait": 1},
                              APPLY: dict(FINITE)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_host_syncs_do_not_grow_with_params(backend, cfg):
    """The host-blocking calls of a steady step, an applying boundary and a reselection, for
    4 and for 16 matrices: exactly these on CPU (EXPECTED; 2, 2, 4 with overlap; 1, 2, 2
    synchronous; 2, 3, 4 with host accumulation), whatever the number of params:

    * every step but a reselection: one ``.tolist()``, the finite check reading its one
      flag vector; a reselection brings the flags in the copy of its picks, before it
      changes anything (``ZenFlowOptimizer._plan``), so it reads none of its own;
    * overlap, steady and reselection: one ``HostWorker.wait_event``, the wait for the host
      job's copy-in of the window launched at the last boundary
      (``HostPipeline.wait_copy_in``) before the accumulators are written again. On CPU
      the job's thread makes that copy from CPU sources; with CUDA sources the training
      stream waits for it on the device, not the host (so a GPU run has one fewer);
    * overlap, apply and reselection: one ``HostWorker.wait``, for the job launched
      ``update_interval`` steps before, whose result is applied now;
    * synchronous (``overlap=False``), apply: one ``HostWorker.wait``, for the job launched
      in this very step (which copied this window from the device): the device is drained
      at every boundary; its reselection applies nothing new (the boundary before did);
    * host accumulation, every step: one ``HostWorker.wait`` in ``HostPipeline.check`` for
      the accumulation of the step before (finished: the test lets the worker go idle
      before each step, see :func:`idle`), and at apply and reselection the wait for the
      job in flight;
    * a reselection: two blocking ``Link`` transfers, the picks of every param (with the
      check's flags) and the leaving columns (one copy each); a steady or applying step
      makes none.

    With ``check_finite_at="boundary"`` (Triton only) a steady step reads no flag: 0 host
    syncs without overlap, and with overlap only the copy-in wait a CUDA run does not make;
    applying steps read the flags once, reselecting steps in the picks' copy, as before.
    So on CUDA, with the default overlap: 0 host syncs on a steady step, 2 on an applying
    one (the flags, then the host job; docs/design.md, "GPU discipline", says why not 1)
    and 3 on a reselection (the picks with the flags, the host job, the leaving columns).

    On CUDA (bench/gpu_check.sh) the CPU count is an upper bound: each step's count is at
    most the CPU one for its kind, and 4 and 16 matrices make the same calls."""
    if cfg in DEFERRED and backend != "triton":
        pytest.skip("check_finite_at='boundary' needs the Triton backend")
    expected = EXPECTED[cfg]
    got = {n: run_counting(n, backend, **CONFIGS[cfg]) for n in SIZES}
    for t in (STEADY, APPLY, RESELECT):
        want = expected[t]
        for n in SIZES:
            c = got[n][t]
            where = f"{n} matrices, step {t}: {c.syncs} host syncs: {c.sync_sites}"
            if DEVICE == "cpu":
                assert c.kinds() == want, where
                assert c.syncs == sum(want.values()), where
            else:
                assert all(k in want and v <= want[k] for k, v in c.kinds().items()), where
            if t != RESELECT:  # steady and applying steps wait for no transfer at all
                assert BLOCKING_LINK not in c.sync_sites, where
        assert sorted(got[SIZES[0]][t].sync_sites) == sorted(got[SIZES[1]][t].sync_sites)


@pytest.mark.parametrize("backend", BACKENDS)
def test_warmup_boundaries_wait_for_their_job(backend):
    """Warm-up (``warmup_steps=2``): every step is a boundary whose job is applied at once,
    as with ``overlap=False``, so the step waits for the job it launched (which first copied
    the window from the device): one ``HostWorker.wait`` besides the finite check's
    ``.tolist()``, for 4 and 16 matrices. The first step also makes each matrix's state
    (``init_matrix_state``: its host half crosses in one blocking ``Link.to_host`` per
    matrix, once), so it makes 2 + N; the second makes 2."""
    for n in SIZES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(n)]).to(DEVICE)
        gen = torch.Generator().manual_seed(1)
        with ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2,
                              min_offload_numel=64, backend=backend, warmup_steps=2) as opt:
            counts = []
            for _ in range(2):
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
                idle(opt)
                counts.append(count_step(opt))
            assert opt.stats()["host_updates"] == 2
        first, second = counts
        wait = {**FINITE, "HostWorker.wait": 1}
        if DEVICE == "cpu":
            assert first.kinds() == {**wait, BLOCKING_LINK: n}, (n, first.sync_sites)
            assert second.kinds() == wait, (n, second.sync_sites)
        else:
            assert second.kinds().get("HostWorker.wait") == 1, (n, second.sync_sites)
            assert second.syncs <= 2, (n, second.sync_sites)


@pytest.mark.skipif("triton" not in BACKENDS, reason=triton_available()[1])
@pytest.mark.parametrize("cfg", [dict(overlap=True), dict(overlap=False),
                                 dict(overlap=True, dtype=torch.bfloat16)],
                         ids=["overlap", "sync", "overlap-bf16"])
def test_triton_launches_grow_with_groups_not_params(cfg):
    """Work-launching ops (dispatched aten and custom ops other than views, plus Triton
    kernel launches) of a steady step and of an applying boundary: 16 matrices cost
    exactly what 4 cost on CPU (94 and 123 ops), so one op per param fails; on CUDA at most
    1.5x."""
    small, large = (run_counting(n, "triton", **cfg) for n in SIZES)
    for t in (STEADY, APPLY):
        a, b = small[t], large[t]
        where = f"step {t}: {a.ops} ops for {SIZES[0]} matrices, {b.ops} for {SIZES[1]}"
        if DEVICE == "cpu":
            assert b.ops == a.ops, f"{where}: {b.op_names}"
        assert b.ops <= 1.5 * a.ops, f"{where}: {b.op_names}"


def test_counting_sees_syncs_in_library_code_only():
    """Guards the counter: the single-param migrate (kept for tests) reads the new indices
    back with .cpu() and the leaving columns with a blocking copy, in library code: both
    counted; a test's own .item() is not the library's and is not counted."""
    from zenflow_triton.kernels import get_ops
    from zenflow_triton.state import init_matrix_state
    from zenflow_triton.columns.migration import migrate
    from zenflow_triton.transfer import Link

    from .support.counting import counting

    p, link = torch.randn(6, 10), Link()
    st = init_matrix_state(p, link)
    migrate(p, st, torch.tensor([1, 4]), beta1=0.9, beta2=0.999, ops=get_ops("torch"),
            link=link)
    with counting(link) as c:
        torch.ones(()).item()  # the test's, not the library's
        migrate(p, st, torch.tensor([2, 4]), beta1=0.9, beta2=0.999, ops=get_ops("torch"),
                link=link)
    assert any(".cpu() at columns/migration.py" in s for s in c.sync_sites), c.sync_sites
    assert "a blocking transfer (Link)" in c.sync_sites
    assert c.syncs == 2, c.sync_sites


def library_code(src: str) -> dict:
    """``src`` run as if it were the library's (its code objects carry a file name under
    zenflow_triton/, which is how the counter tells the library's calls from a test's)."""
    import zenflow_triton

    path = os.path.join(os.path.dirname(zenflow_triton.__file__), "_injected_by_test.py")
    ns: dict = {"torch": torch}
    exec(compile(src, path, "exec"), ns)
    return ns


def test_counter_counts_every_kind_of_blocking_call_once():
    """Guards the counter: each kind of host-blocking call, made from library code on the
    counting thread, counts exactly once (a call inside a counted one, such as
    HostWorker.wait's wait_event or Link.to_host's copy, not again); what would not block on
    a GPU does not count (a non-blocking copy, a cast, a copy within the device or from the
    host, the Link's non-blocking transfers), nor the host worker thread's own calls."""
    from zenflow_triton.host.worker import HostWorker
    from zenflow_triton.transfer import Link

    from .support.counting import counting

    ns = library_code('''
import threading

def blocking(dev, host, worker, link):
    dev.to("cpu")                          # 1: a blocking copy to the host
    dev.to(device=torch.device("cpu"))     # 2
    dev.to("cpu", torch.float64)           # 3: to the host and cast
    host.copy_(dev)                        # 4: a copy into host memory
    (dev * 2).to("cpu")                    # 5: computed from device memory: the device's
    dev.sum().item()                       # 6
    bool(dev[0] > 0)                       # 7
    torch.tensor([1.0], device="meta")     # 8: not the host
    for sync in (torch.cuda.synchronize,   # 9, 10, 11 (raise on a CPU-only torch)
                 lambda: torch.cuda.Stream.synchronize(None),
                 lambda: torch.cuda.Event.synchronize(None)):
        try:
            sync()
        except Exception:
            pass
    job = worker.submit(lambda: None, "a job")
    worker.wait(job)                       # 12 (its wait_event inside: not again)
    done = threading.Event()
    done.set()
    worker.wait_event(done, "an event")    # 13
    link.to_host(dev)                      # 14: the Link counts it (not its copy_ again)

def not_blocking(dev, host, worker, link):
    dev.to("cpu", non_blocking=True)
    host.copy_(dev, non_blocking=True)
    dev.to(torch.float64)                  # a cast on the device
    dev.copy_(host)                        # host to device
    host.to("cpu")                         # host memory already
    host.clone().copy_(host)
    torch.tensor([1.0])
    torch.tensor([1.0], device="cpu")
    link.to_host_async(dev)                # non-blocking: its CPU-run copy is the Link's
    link.copy_in([(host.clone(), dev, False, None)])
    job = worker.submit(lambda: dev.to("cpu").tolist(), "the worker's own")
    job.done.wait(10)
''')
    before = {name: vars(owner).get(name) for owner, name in (
        (torch.Tensor, "to"), (torch.Tensor, "copy_"), (torch.Tensor, "cpu"),
        (HostWorker, "wait"), (torch, "tensor"))}
    dev, host = torch.ones(8), torch.zeros(8)
    worker, link = HostWorker(timeout=10.0), Link()
    try:
        with counting(link, [dev]) as c:
            ns["blocking"](dev, host, worker, link)
        assert c.syncs == 14, c.sync_sites
        assert c.kinds() == {".to(host)": 4, ".copy_(host <- device)": 1,
                             "aten::_local_scalar_dense": 2, "torch.tensor(device=...)": 1,
                             "torch.cuda.synchronize": 1, "torch.cuda.Stream.synchronize": 1,
                             "torch.cuda.Event.synchronize": 1, "HostWorker.wait": 1,
                             "HostWorker.wait_event": 1, BLOCKING_LINK: 1}, c.sync_sites
        with counting(link, [dev]) as c:
            ns["not_blocking"](dev, host, worker, link)
        assert c.syncs == 0, c.sync_sites
    finally:
        worker.close()
    # After the block every patch is gone.
    assert before == {name: vars(owner).get(name) for owner, name in (
        (torch.Tensor, "to"), (torch.Tensor, "copy_"), (torch.Tensor, "cpu"),
        (HostWorker, "wait"), (torch, "tensor"))}


def test_an_extra_blocking_copy_per_param_is_caught(monkeypatch):
    """Guards the counter on a real step: a blocking ``.to("cpu")`` of each matrix's gradient
    in the device half (injected into ``DeviceHalf._entries``, once per matrix per step, as
    library code) adds exactly one counted sync per matrix to every counted step."""
    from zenflow_triton.device import DeviceHalf

    ns = library_code('''
def entries(self, p, g, *args, **kwargs):
    g.to("cpu")  # a gradient read back to the host, blocking, per param
    return real(self, p, g, *args, **kwargs)
''')
    ns["real"] = DeviceHalf._entries
    monkeypatch.setattr(DeviceHalf, "_entries", ns["entries"])
    for n in SIZES:
        counts = run_counting.__wrapped__(n, "torch")
        for t in (STEADY, APPLY, RESELECT):
            want = {**EXPECTED["overlap"][t], ".to(host)": n}
            assert counts[t].kinds() == want, (n, t, counts[t].sync_sites)


@pytest.mark.skipif("triton" not in BACKENDS, reason=triton_available()[1])
def test_address_tables_travel_only_when_the_tensors_change():
    """The multi-tensor launches' address tables (``kernels._multi.tables``) are cached by
    content: with gradients written in place (``zero_grad(set_to_none=False)``), a step
    that neither reselects nor applies a window sends none, while each launch still sends its
    per-tensor scalars; a reselection (new index sets) sends new ones."""
    from zenflow_triton.kernels import _multi

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    sent = {}
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2,
                          select_interval=4, min_offload_numel=64, backend="triton",
                          fresh_if_spread=False) as opt:
        for t in range(1, 12):
            for p in model.parameters():
                p.grad.copy_(torch.randn(p.shape, generator=gen))
            before = dict(_multi.UPLOADS)
            refreshes = opt.stats()["selection_refreshes"]
            opt.step()
            reselected = opt.stats()["selection_refreshes"] > refreshes
            sent[t] = ({k: _multi.UPLOADS[k] - before.get(k, 0) for k in ("rows", "hyper")},
                       reselected)
    # t = 1, 5, 9 reselect; t = 4, 8 apply the first window after one (new host columns).
    for t, (d, reselected) in sent.items():
        assert d["hyper"] == 2, (t, d)  # the matrices' launch and the small params' launch
        if reselected:
            assert d["rows"] > 0, (t, d)
        elif t % 4 != 0:
            assert d["rows"] == 0, (t, sent)
    assert [t for t, (_, r) in sent.items() if r] == [1, 5, 9], sent
