"""Stress: many steps with tiny chunks, update_interval=2, several host threads, and random
synchronize() / state_dict() / save-and-resume calls between steps. The result must follow
the single-threaded reference (tests/reference.py) given the same synchronize() points, to
fp32 rounding on a seeded gradient feed (helpers.fp32_run_tol), be bit-identical across
thread counts and chunk sizes, and never hang."""

from __future__ import annotations

import io
import random

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer

from .support.helpers import (FeedModel, GradFeed, assert_trajectories_close, param_groups,
                              params_of, warmup_lambda)
from .support import reference

STEPS = 40
LR = 1e-2

CONFIGS = {
    "overlap-dev": dict(topk_ratio=0.2, update_interval=2, select_interval=4, overlap=True,
                        accumulate_on="device"),
    "sync-host-warmup": dict(topk_ratio=0.3, update_interval=2, select_interval=6,
                             overlap=False, accumulate_on="host", warmup_steps=3),
}


def schedule(seed: int) -> list[str]:
    """What to do after each step: nothing, synchronize, state_dict, or save-and-resume."""
    rng = random.Random(seed)
    return [rng.choices(["-", "sync", "state_dict", "resume"], weights=[5, 1, 2, 1])[0]
            for _ in range(STEPS)]


def set_lrs(groups, base, i):
    for g, lr0 in zip(groups, base):
        g["lr"] = lr0 * warmup_lambda(i)


def run_zenflow(feed, plan, cfg, **host):
    model = FeedModel()
    groups = param_groups(model, lr=LR)
    base = [g["lr"] for g in groups]
    opt = ZenFlowOptimizer(groups, min_offload_numel=64, host_timeout=30.0, **cfg, **host)
    try:
        for i, (x, action) in enumerate(zip(feed.batches, plan)):
            set_lrs(opt.param_groups, base, i)
            model.zero_grad()
            feed.loss(model, x).backward()
            opt.step()
            if action == "sync":
                opt.synchronize()
            elif action == "state_dict":
                opt.state_dict()
            elif action == "resume":  # a new optimizer from the saved state goes on
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt.close(finish=False)  # handed over: the new optimizer goes on
                opt = ZenFlowOptimizer(param_groups(model, lr=LR), min_offload_numel=64,
                                       host_timeout=30.0, **cfg, **host)
                opt.load_state_dict(torch.load(buf, weights_only=True))
        opt.synchronize()
        return params_of(model), opt.stats()
    finally:
        opt.close()


def run_reference(feed, plan, cfg):
    model = FeedModel()
    sync_after = {i for i, action in enumerate(plan) if action == "sync"}
    ref = reference.run_reference(model, feed.batches, feed.loss, param_groups(model, lr=LR),
                                  warmup_lambda, sync_after=sync_after, **cfg)
    assert ref.min_selection_gap > 1e-3, ref.min_selection_gap
    return params_of(model)


@pytest.fixture
def one_intra_op_thread():
    """The model is tiny: torch's intra-op threads only add OpenMP barriers (which crawl on a
    loaded machine). The host pool keeps its own threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_intra_op_thread")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stress_matches_reference_and_is_thread_independent(name, seed):
    cfg = CONFIGS[name]
    feed = GradFeed(STEPS, seed=10 + seed, pull=0.3)
    plan = schedule(seed)
    assert {"sync", "state_dict", "resume"} <= set(plan)
    got, stats = run_zenflow(feed, plan, cfg, host_threads=3, chunk_size=1)
    assert stats["host_updates"] > 0 and stats["steps"] == STEPS
    assert not stats["host_inflight"]
    want = run_reference(feed, plan, cfg)
    assert_trajectories_close(got, want, STEPS, LR * cfg["update_interval"])
    again, _ = run_zenflow(feed, plan, cfg, host_threads=1, chunk_size=1 << 20)
    for a, b in zip(got, again):
        assert torch.equal(a, b)
