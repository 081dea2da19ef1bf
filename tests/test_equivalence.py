"""The equivalences of docs/design.md, against outside oracles: torch.optim.AdamW and the
single-threaded pure-Python reference of the schedule (tests/reference.py).

Every comparison here is between two different implementations, so it runs on a seeded
gradient feed (helpers.GradFeed: bit-identical gradients for bit-identical params, column
scores well apart) and asserts to fp32_run_tol(), a bound on fp32 rounding over the run; the
``*_differs_*`` guards show that bound is tight enough to see the schedule's decisions.
Bit-exact checks are kept for the same computation (thread counts, chunk sizes)."""

from __future__ import annotations

import math

import pytest
import torch

from zenflow_triton import ZenFlowConfig, ZenFlowOptimizer

from .support.helpers import (FeedModel, GradFeed, assert_not_close, assert_trajectories_close,
                              batches, fp32_masters, loss_fn, make_model, param_groups,
                              params_of, train, train_feed, warmup_lambda)
from .support import reference

STEPS = 30
LR = 1e-2  # large enough that a window applied at the wrong step shows far above rounding


def groups(model, **kw):
    return param_groups(model, lr=LR, **kw)


def run_adamw(feed, dtype=torch.float32, clip=None, groups_fn=groups, steps=None):
    model = FeedModel(dtype)
    opt = torch.optim.AdamW(groups_fn(model), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
    return params_of(train_feed(model, opt, feed, sched, clip=clip, steps=steps))


def run_zenflow(feed, dtype=torch.float32, clip=None, groups_fn=groups, steps=None,
                zero_grad_via_model=False, masters=False, **cfg):
    model = FeedModel(dtype)
    cfg.setdefault("min_offload_numel", 64)
    with ZenFlowOptimizer(groups_fn(model), **cfg) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
        train_feed(model, opt, feed, sched, clip=clip, steps=steps,
                   zero_grad_via_model=zero_grad_via_model)
        opt.synchronize()
        stats = opt.stats()
        out = fp32_masters(opt, list(model.parameters())) if masters else params_of(model)
    return out, stats


def run_reference(feed, dtype=torch.float32, masters=False, clip=None, **cfg):
    model = FeedModel(dtype)
    ref = reference.run_reference(model, feed.batches, feed.loss, groups(model),
                                  warmup_lambda, clip=clip, **cfg)
    return (ref.masters(list(model.parameters())) if masters else params_of(model)), ref


def host_lr(cfg) -> float:
    """The largest lr any host update of ``cfg`` uses (warmup_lambda is at most 1)."""
    scale = cfg.get("host_lr_scale", ZenFlowConfig().host_lr_scale)
    full = ZenFlowConfig(update_interval=cfg.get("update_interval", 4), host_lr_scale=scale)
    if scale == "adaptive":  # at most n (step_size.multiplier)
        return LR * full.update_interval
    return LR * max(1.0, full.effective_host_lr_scale)


# ------------------------------------------------------------------ against torch AdamW
def test_topk_one_equals_adamw():
    feed = GradFeed(STEPS)
    got, stats = run_zenflow(feed, topk_ratio=1.0, update_interval=4)
    assert stats["device_owned_fraction"] == 1.0
    assert stats["host_updates"] == 0
    assert_trajectories_close(got, run_adamw(feed), STEPS, LR)


@pytest.mark.parametrize("ratio,rule", [(0.0, "sqrt"), (0.05, "sqrt"), (0.3, "sqrt"),
                                        (0.7, "sqrt"), (1.0, "sqrt"), (0.3, "adaptive")])
def test_interval_one_no_overlap_equals_adamw(ratio, rule):
    feed = GradFeed(STEPS)
    # Reselect every 3 steps so columns migrate between owners during the run.
    got, stats = run_zenflow(feed, topk_ratio=ratio, update_interval=1, select_interval=3,
                             overlap=False, zero_grad_via_model=True, host_lr_scale=rule)
    if 0.0 < ratio < 1.0:
        assert stats["columns_migrated"] > 0
    assert_trajectories_close(got, run_adamw(feed), STEPS, LR)


@pytest.mark.parametrize("overlap", [False, True])
def test_window_betas_of_one_step_windows_are_the_betas(overlap):
    """A window of one gradient decays the moments by beta ** 1: host_betas="window" is
    the same computation as "step" at update_interval=1, to the bit."""
    feed = GradFeed(STEPS)
    cfg = dict(topk_ratio=0.3, update_interval=1, select_interval=3, overlap=overlap)
    got, _ = run_zenflow(feed, host_betas="window", **cfg)
    want, _ = run_zenflow(feed, host_betas="step", **cfg)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_zero_offload_mode_updates_everything_on_host():
    feed = GradFeed(8)
    got, stats = run_zenflow(feed, topk_ratio=0.0, update_interval=1, overlap=False)
    assert stats["host_updates"] == 8
    assert_trajectories_close(got, run_adamw(feed), 8, LR)


@pytest.mark.parametrize("host_lr_scale", ["auto", 2.0])
def test_warmup_is_plain_adamw(host_lr_scale):
    """Warm-up steps are ZeRO-Offload semantics: one AdamW step per step at the group's lr,
    whatever update_interval and host_lr_scale say about later windows."""
    feed = GradFeed(8)
    got, stats = run_zenflow(feed, topk_ratio=0.2, update_interval=4, warmup_steps=8,
                             host_lr_scale=host_lr_scale)
    assert stats["host_updates"] == 8 and stats["steps"] == 8
    assert_trajectories_close(got, run_adamw(feed, steps=8), 8, LR)


@pytest.mark.parametrize("betas_eps", [((0.8, 0.95), 1e-6), ((0.5, 0.9), 1e-3)])
def test_per_group_betas_and_eps_equal_adamw(betas_eps):
    """Non-default betas and eps per group reach both halves (device kernels and host
    AdamW), as torch.optim.AdamW applies them."""
    betas, eps = betas_eps

    def groups_fn(model):
        g = groups(model)
        g[0].update(betas=betas, eps=eps)  # the matrices: split between device and host
        g[1].update(betas=(0.85, 0.99), eps=1e-7)
        return g

    feed = GradFeed(STEPS)
    for ratio in (0.3, 0.0):
        got, stats = run_zenflow(feed, groups_fn=groups_fn, topk_ratio=ratio,
                                 update_interval=1, select_interval=3, overlap=False)
        want = run_adamw(feed, groups_fn=groups_fn)
        assert_trajectories_close(got, want, STEPS, LR, betas=[betas, (0.85, 0.99)])
    # The guard: the defaults' trajectory is not this one.
    assert_not_close(run_adamw(feed), want, STEPS, LR, betas=[betas, (0.85, 0.99)])


def test_bf16_params_interval_one_equal_adamw_on_fp32_masters():
    """bf16 params keep fp32 masters: with one-step windows the masters follow AdamW run on
    fp32 weights (same gradients) to fp32 rounding, and each bf16 param is its master
    rounded. A kernel that updated the bf16 param without a master would drift from AdamW by
    bf16 rounding, far outside the bound."""
    feed = GradFeed(STEPS, pull=0.0, grid=torch.bfloat16)
    masters, stats = run_zenflow(feed, dtype=torch.bfloat16, masters=True, topk_ratio=0.3,
                                 update_interval=1, select_interval=3, overlap=False)
    assert stats["columns_migrated"] > 0
    fp32_model = FeedModel(torch.bfloat16).float()  # the same starting values, in fp32
    opt = torch.optim.AdamW(groups(fp32_model), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
    want = params_of(train_feed(fp32_model, opt, feed, sched))
    assert_trajectories_close(masters, want, STEPS, LR, what="fp32 master")
    got_params, _ = run_zenflow(feed, dtype=torch.bfloat16, topk_ratio=0.3,
                                update_interval=1, select_interval=3, overlap=False)
    for p, m in zip(got_params, masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))


@pytest.mark.parametrize("ratio", [0.0, 0.3])
def test_clip_then_step_equals_adamw_with_the_same_clipping(ratio):
    """clip_grad_norm_ before step() clips every column alike, device- or host-owned: with
    one-step windows, clip-then-step equals AdamW with the same clipping."""
    feed = GradFeed(STEPS)
    clip = 5.0  # below the feed's gradient norms, which vary step to step: a varying factor
    got, _ = run_zenflow(feed, clip=clip, topk_ratio=ratio, update_interval=1,
                         select_interval=3, overlap=False)
    want = run_adamw(feed, clip=clip)
    assert_trajectories_close(got, want, STEPS, LR)
    assert_not_close(run_adamw(feed), want, STEPS, LR)  # the clipping did change the run


def test_deferred_schedule_differs_from_adamw():
    """Guards the tests above: with a real window the trajectory is not AdamW's."""
    feed = GradFeed(12)
    got, _ = run_zenflow(feed, topk_ratio=0.2, update_interval=4, overlap=True)
    assert_not_close(got, run_adamw(feed), 12, host_lr({"update_interval": 4}))


@pytest.mark.parametrize("rule,interval,moves", [("auto", 4, (4, 2)),
                                                  ("sqrt", 4, (2, math.sqrt(2))),
                                                  ("sqrt", 8, (2, math.sqrt(2)))])
def test_host_scale_follows_the_window_gradient_count(rule, interval, moves):
    """Under host_lr_scale="auto" a window's host step is scaled by the number of gradients
    n the param accumulated in it, so with a constant gradient a deferred column travels as
    far as it would under AdamW: a param with a gradient on all 4 steps of a window moves 4
    AdamW steps, one that gets its first gradient 2 steps before the window ends moves 2
    (not 4). Under "sqrt" (the default) the same windows move sqrt(4) = 2 and sqrt(2) steps,
    and a full window of 8 moves 2, the cap, not sqrt(8)."""
    torch.manual_seed(0)
    full = torch.nn.Parameter(torch.randn(16, 8))
    late = torch.nn.Parameter(torch.randn(16, 8))
    # |g| >= 0.5: each AdamW step is g / (|g| + eps), within 2e-8 of sign(g).
    g_full, g_late = (torch.randn(16, 8).sign() * (0.5 + torch.rand(16, 8)) for _ in "ab")
    lr = 1e-2

    def run(make_opt):
        for p, w in ((full, w_full), (late, w_late)):
            p.data.copy_(w)
        opt = make_opt([full, late])
        for t in range(1, interval + 1):
            full.grad = g_full.clone()
            late.grad = g_late.clone() if t >= interval - 1 else None
            opt.step()
        if hasattr(opt, "close"):
            opt.close()
        return [full.detach().clone(), late.detach().clone()]

    w_full, w_late = full.detach().clone(), late.detach().clone()
    got = run(lambda ps: ZenFlowOptimizer(ps, lr=lr, weight_decay=0.0, topk_ratio=0.0,
                                          update_interval=interval, overlap=False,
                                          min_offload_numel=1, host_lr_scale=rule))
    # A constant gradient makes every AdamW step g / (|g| + eps), and so every host step
    # (the window mean is g): the window moves the param by its multiplier times lr.
    for p, w, m in zip(got, (w_full, w_late), moves):
        moved = (p - w).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, m * lr), rtol=1e-4, atol=0)
    if rule == "auto":  # as far as AdamW travels in the same steps
        want = run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0, foreach=False))
        assert_trajectories_close(got, want, interval, interval * lr)


@pytest.mark.parametrize("rule,n", [(1.0, 4), ("auto", 4), (1.0, 3)])
def test_a_window_takes_the_mean_of_its_steps_lrs(rule, n):
    """Under a schedule a window's host step takes the mean of its own steps' learning rates,
    not the lr of the step that closes it: with a constant gradient (every Adam step is
    g / (|g| + eps)) and lrs 1, 2, 3, 4 x 1e-3 over a window of 4, a deferred column moves
    2.5e-3 at host_lr_scale 1.0 (the closing step's lr would move it 4e-3) and 1e-2 under
    "auto", as far as AdamW's four steps (1e-3 + ... + 4e-3). A window that gets its first
    gradient at step 2 of 4 (n = 3) takes the mean of steps 2-4 (3e-3)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 8))
    w0 = p.detach().clone()
    g = torch.randn(16, 8).sign() * (0.5 + torch.rand(16, 8))
    opt = ZenFlowOptimizer([p], lr=1e-3, weight_decay=0.0, topk_ratio=0.0, update_interval=4,
                           overlap=False, min_offload_numel=1, host_lr_scale=rule)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: float(i + 1))
    for t in range(1, 5):
        p.grad = g.clone() if t > 4 - n else None
        opt.step()
        sched.step()
    opt.close()
    lrs = [1e-3 * i for i in range(5 - n, 5)]
    mean = sum(lrs) / n
    want = mean * (n if rule == "auto" else 1.0)
    moved = (p.detach() - w0).abs()
    torch.testing.assert_close(moved, torch.full_like(moved, want), rtol=1e-4, atol=0)


# ------------------------------------------------------------------ against the reference
SCHEDULES = [
    # "sqrt" below its cap (sqrt(4) = 2); the reference's default is the library's
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
         host_lr_scale="sqrt"),
    dict(topk_ratio=0.1, update_interval=3, select_interval=6, overlap=False,
         host_lr_scale="auto"),
    dict(topk_ratio=0.3, update_interval=2, select_interval=4, overlap=True, warmup_steps=5),
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
         host_lr_scale="auto"),
    # ZenFlow's and DeepSpeed's semantics: one ordinary step per window
    dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap=True, warmup_steps=2,
         host_lr_scale=1.0),
    # the "sqrt" rule at its cap (sqrt(8) > 2)
    dict(topk_ratio=0.2, update_interval=8, select_interval=8, overlap=True,
         host_lr_scale="sqrt"),
    # the adaptive rule, the default: the job reads the host moments before each host step
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True),
    # every column host-owned, synchronous: the job streams the accumulator piece by piece
    # and writes the params itself
    dict(topk_ratio=0.0, update_interval=2, select_interval=4, overlap=False),
    # a result applied 1 step after its window (the reselection's drain comes first at
    # steps 1 + 8j), and 2 of 4 with warm-up
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True, apply_delay=1),
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True, apply_delay=2,
         warmup_steps=3, host_lr_scale="sqrt"),
    # per-window betas (beta ** n): with the adaptive rule, and after a warm-up of one-step
    # windows (the host's gradient count is then no multiple of n: a fractional step)
    dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
         host_betas="window"),
    dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap=True, warmup_steps=2,
         host_lr_scale="auto", host_betas="window"),
]


def _ids(cfg):
    return "-".join(f"{k}{v}" for k, v in cfg.items())


@pytest.mark.parametrize("cfg", SCHEDULES, ids=_ids)
def test_async_schedule_matches_single_threaded_reference(cfg):
    feed = GradFeed(STEPS)
    got, stats = run_zenflow(feed, host_threads=2, chunk_size=97, **cfg)
    assert stats["host_updates"] > 0 and stats["selection_refreshes"] >= 3
    want, ref = run_reference(feed, **cfg)
    # The comparison rests on the same selections: their scores are far apart.
    assert ref.min_selection_gap > 1e-3, ref.min_selection_gap
    assert_trajectories_close(got, want, STEPS, host_lr(cfg))


@pytest.mark.parametrize("base,change", [(2, dict(overlap=False)), (2, dict(host_lr_scale=4.0)),
                                         (-4, dict(apply_delay=None)), (-4, dict(apply_delay=2)),
                                         (-3, dict(apply_delay=1)), (-3, dict(apply_delay=3)),
                                         (-3, dict(apply_delay=None)),
                                         (-2, dict(host_betas="step")),
                                         (-1, dict(host_betas="step"))],
                         ids=["apply-one-window-early", "fixed-scale-in-warmup",
                              "delay1-at-boundary", "delay1-as-2", "delay2-as-1", "delay2-as-3",
                              "delay2-at-boundary", "window-betas-as-step",
                              "window-betas-as-step-after-warmup"])
def test_reference_comparison_differs_when_the_schedule_differs(base, change):
    """Guards the reference comparison: applying the window one boundary early, scaling the
    warm-up's host lr, applying a result one step earlier or later than its
    ``apply_delay``, or decaying the host moments once per window instead of ``n`` times
    gives a trajectory outside the bound."""
    cfg = SCHEDULES[base]
    feed = GradFeed(STEPS)
    got, _ = run_zenflow(feed, host_threads=2, chunk_size=97, **cfg)
    want, _ = run_reference(feed, **{**cfg, **change})
    assert_not_close(got, want, STEPS, host_lr(cfg))


@pytest.mark.parametrize("accumulate_on,rule", [("device", "sqrt"), ("host", "sqrt"),
                                                ("device", "adaptive")])
def test_overlap_runs_are_bit_identical(accumulate_on, rule):
    """The same computation with other thread counts and chunk sizes: bit for bit (a real
    model, whose gradients feed back through every layer; the adaptive step size reads the
    moments by a fixed sample, whatever the threads)."""
    data = batches(STEPS)

    def run(**host):
        model = make_model()
        with ZenFlowOptimizer(param_groups(model), min_offload_numel=64, topk_ratio=0.15,
                              update_interval=4, select_interval=8, overlap=True,
                              accumulate_on=accumulate_on, host_lr_scale=rule,
                              **host) as opt:
            train(model, opt, data, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda))
            opt.synchronize()
        return params_of(model)

    a = run(host_threads=2, chunk_size=50)
    b = run(host_threads=1, chunk_size=1 << 20)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=True),
    dict(topk_ratio=0.0, update_interval=1, select_interval=4, overlap=False),  # job stores
    dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=False),  # streamed
    dict(topk_ratio=0.25, update_interval=2, select_interval=4, overlap=True,
         accumulate_on="host"),
], ids=["overlap", "zero-offload", "sync", "host-acc"])
def test_bf16_params_follow_reference(cfg):
    """bf16 params: the fp32 masters follow the reference's fp32 weights to fp32 rounding,
    and every bf16 param is its master rounded (nothing else: no update of the bf16 value
    itself, no round trip of a master through bf16). A window mean made in the device
    accumulator reaches the host AdamW rounded once to bf16, staged or streamed; a host
    accumulator's is not rounded (the reference does the same)."""
    steps = 16
    feed = GradFeed(steps, pull=0.0, grid=torch.bfloat16)
    masters, _ = run_zenflow(feed, dtype=torch.bfloat16, masters=True, **cfg)
    want, _ = run_reference(feed, dtype=torch.bfloat16, masters=True, **cfg)
    assert_trajectories_close(masters, want, steps, host_lr(cfg), what="fp32 master")
    params, _ = run_zenflow(feed, dtype=torch.bfloat16, **cfg)
    for p, m in zip(params, masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))


@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.2, update_interval=3, select_interval=6, overlap=True),
    dict(topk_ratio=0.0, update_interval=1, select_interval=4, overlap=True),  # .grad itself
], ids=["accumulator-on-loan", "grad-on-loan"])
def test_slow_copy_in_cannot_race_the_training_loop(cfg, monkeypatch):
    """The host job copies the window's gradient off its sources itself. Make that copy slow:
    if the next accumulation (or the caller zeroing .grad in place) did not wait for it, the
    job would copy the wrong numbers and the trajectory would leave the reference's."""
    import time as _time

    from zenflow_triton.transfer import CopyIn

    real = CopyIn.wait_on_host
    calls = []

    def slow(self, timeout):  # on CPU the job's thread makes the copies here
        calls.append(1)
        _time.sleep(0.05)
        return real(self, timeout)

    monkeypatch.setattr(CopyIn, "wait_on_host", slow)
    steps = 12
    feed = GradFeed(steps)
    model = FeedModel()
    with ZenFlowOptimizer(groups(model), min_offload_numel=64, **cfg) as opt:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
        for t in feed.batches:
            feed.loss(model, t).backward()
            opt.step()
            sched.step()
            for p in model.parameters():  # in place, as zero_grad(set_to_none=False) does
                p.grad.zero_()
        opt.synchronize()
    monkeypatch.undo()
    assert calls  # the copies went through the slowed path
    want, _ = run_reference(feed, **cfg)
    assert_trajectories_close(params_of(model), want, steps, host_lr(cfg))


def test_slow_host_accumulation_does_not_block_the_training_thread(monkeypatch):
    """accumulate_on="host": the host-owned columns cross without blocking and the host
    worker adds them. Make every add slow: the steps inside a window must still return at
    once (they only queue work), and the run must be bit for bit the unslowed one."""
    import time as _time

    from zenflow_triton.host import HostWorker

    cfg = dict(topk_ratio=0.2, update_interval=4, select_interval=8, overlap=True,
               accumulate_on="host")
    feed = GradFeed(12)

    def run():
        model = FeedModel()
        times = []
        with ZenFlowOptimizer(groups(model), min_offload_numel=64, **cfg) as opt:
            for t in feed.batches:
                opt.zero_grad()
                feed.loss(model, t).backward()
                t0 = _time.perf_counter()
                opt.step()
                times.append(_time.perf_counter() - t0)
            opt.synchronize()
        return params_of(model), times

    want, _ = run()
    real_submit = HostWorker.submit
    delay = 0.4
    slowed = []

    def slow_submit(self, fn, label):
        if label.startswith("host accumulation"):
            def slow():
                slowed.append(label)
                _time.sleep(delay)
                fn()
            return real_submit(self, slow, label)
        return real_submit(self, fn, label)

    monkeypatch.setattr(HostWorker, "submit", slow_submit)
    got, times = run()
    assert len(slowed) == 12  # every step's accumulation went through the worker
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Steps 2 and 3 of each window (u % 4 in {2, 3}) neither launch nor apply a window: they
    # only queue their adds, behind adds that each take `delay`.
    inside = [times[t] for t in range(len(times)) if (t + 1) % 4 in (2, 3)]
    assert max(inside) < delay / 2, inside


# ------------------------------------------------------------------ low-precision state
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [
    dict(topk_ratio=0.25, update_interval=3, select_interval=6, overlap=True),   # staged
    dict(topk_ratio=0.25, update_interval=3, select_interval=6, overlap=False),  # streamed
    dict(topk_ratio=0.25, update_interval=3, select_interval=6, overlap=True,
         accumulate_on="host"),
], ids=["overlap", "sync", "host-acc"])
def test_bf16_accumulator_follows_reference(cfg, dtype):
    """accumulator_dtype="bfloat16": each step's window sum is rounded to bf16 (an fp32 add,
    rounded to nearest even) and the mean is taken in fp32 from it; the reference does the
    same. A guard shows the rounding is seen: the fp32-accumulator reference is not met."""
    steps = 16
    cfg = dict(cfg, accumulator_dtype="bfloat16")
    feed = GradFeed(steps, pull=0.0, grid=dtype)
    got, _ = run_zenflow(feed, dtype=dtype, masters=True, **cfg)
    want, _ = run_reference(feed, dtype=dtype, masters=True, **cfg)
    assert_trajectories_close(got, want, steps, host_lr(cfg), what="fp32 master")
    if dtype == torch.float32:  # a bf16 gradient sums exactly over a short window
        fp32_acc, _ = run_reference(feed, dtype=dtype, masters=True,
                                    **dict(cfg, accumulator_dtype="float32"))
        assert_not_close(got, fp32_acc, steps, host_lr(cfg))


def test_bf16_host_moments_stay_bf16_and_runs_are_deterministic():
    """host_state_dtype="bfloat16": the host moments are bf16 after steps, migrations and a
    save/load; the run is bit for bit the same across host thread counts and chunk sizes
    (the same computation), resumes bit for bit, and stays near the fp32-moment run."""
    import io as _io

    steps = 24
    feed = GradFeed(steps)
    cfg = dict(topk_ratio=0.25, update_interval=3, select_interval=6, overlap=True,
               host_state_dtype="bfloat16")

    def run(threads, chunk, resume_at=None):
        model = FeedModel()
        opt = ZenFlowOptimizer(groups(model), min_offload_numel=64, host_threads=threads,
                               chunk_size=chunk, **cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda)
        for i, t in enumerate(feed.batches):
            model.zero_grad()
            feed.loss(model, t).backward()
            opt.step()
            sched.step()
            if i == resume_at:
                buf = _io.BytesIO()
                torch.save(opt.state_dict(), buf)
                opt.close(finish=False)  # handed over: the new optimizer goes on
                buf.seek(0)
                opt = ZenFlowOptimizer(groups(model), min_offload_numel=64,
                                       host_threads=threads, chunk_size=chunk, **cfg)
                opt.load_state_dict(torch.load(buf, weights_only=True))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda,
                                                          last_epoch=i)
        opt.synchronize()
        kinds = {st["host_m"].dtype for st in opt.state.values() if "host_m" in st}
        kinds |= {st["host_v"].dtype for st in opt.state.values() if "host_v" in st}
        moved = opt.stats()["columns_migrated"]
        opt.close()
        return params_of(model), kinds, moved

    a, kinds, moved = run(1, 1 << 20)
    assert kinds == {torch.bfloat16} and moved > 0
    for other in (run(2, 97)[0], run(1, 1 << 20, resume_at=10)[0]):
        for x, y in zip(a, other):
            assert torch.equal(x, y)
    fp32_moments, _ = run_zenflow(feed, **{**cfg, "host_state_dtype": "float32"})
    # Near: each host step rounds m and v to 8 bits of mantissa (relative 2^-9), so an
    # update moves by at most about that fraction of its Adam step more than in fp32.
    drift = max((x - y).abs().max().item() for x, y in zip(a, fp32_moments))
    assert 0 < drift < steps * host_lr(cfg) * 2 ** -6
