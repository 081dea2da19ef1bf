"""fresh_if_spread: the first selection measures how spread the gradient is over the columns
and, where it is spread, the stale default schedule becomes the fresh one (the window's
betas, apply_delay=1); a concentrated gradient keeps it; a stale schedule that stays on a
spread gradient is warned about; a checkpoint carries the choice. And the rule against the
convergence study's rows."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch

from zenflow_triton import ConfigError, ZenFlowOptimizer
from zenflow_triton.columns.spread import SPREAD_SHARE, TRAVEL_LIMIT

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(topk_ratio=0.2, update_interval=4, select_interval=8, min_offload_numel=64,
           host_threads=1, dense_params=())


def model_and_data(concentrated: bool, n: int = 14, seed: int = 0):
    """A 2-layer MLP on inputs whose energy is spread evenly over the 48 input features, or
    held by 4 of them (the first layer's gradient columns follow its inputs)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(48)
    if concentrated:
        scale[:4] = 40.0
    data = [torch.randn(16, 48, generator=g) * scale for _ in range(n)]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 48))
    return model, data


def loss(model, x):
    return (model(x) - x.flip(1)).pow(2).mean()


# the window travel (update_interval x lr / the split weights' RMS, about 0.1 here) stays under
# TRAVEL_LIMIT at NEAR and goes over it at FAR
NEAR, FAR = 1e-5, 1e-2


def run(concentrated: bool, steps: int | None = None, lr: float = FAR,
        **cfg) -> tuple[list, ZenFlowOptimizer]:
    model, data = model_and_data(concentrated)
    opt = ZenFlowOptimizer(model.named_parameters(), lr=lr, **{**CFG, **cfg})
    for x in data[:steps]:
        loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [p.detach().clone() for p in model.parameters()]
    return out, opt


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_spread_gradient_trains_the_fresh_schedule_bit_for_bit():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default acts; it does not warn (far or not)
        got, opt = run(concentrated=False)
    st = opt.stats()["spread"]
    assert st["share"] < SPREAD_SHARE and st["spread"] and st["fresh"]
    assert (opt.config.host_betas, opt.config.apply_delay) == ("window", 1)
    opt.close()
    want, ref = run(concentrated=False, host_betas="window", apply_delay=1)
    assert same(got, want)
    stale, ref2 = run(concentrated=False, fresh_if_spread=False)
    assert not same(got, stale)  # the choice changes the run
    for o in (ref, ref2):
        o.close()


def test_a_concentrated_gradient_at_a_short_travel_keeps_the_default_schedule():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, opt = run(concentrated=True, lr=NEAR)
    st = opt.stats()["spread"]
    assert st["share"] >= SPREAD_SHARE and not st["spread"] and not st["fresh"]
    assert st["travel"] < TRAVEL_LIMIT and not st["far"]
    assert (opt.config.host_betas, opt.config.apply_delay) == ("step", None)
    want, ref = run(concentrated=True, lr=NEAR, fresh_if_spread=False)
    assert same(got, want)
    for o in (opt, ref):
        o.close()


def weight_travel(model, lr: float, interval: int = 4) -> float:
    """update_interval x lr / the RMS of the matrices the optimizer splits (all of CFG's)."""
    w = torch.cat([p.detach().flatten() for p in model.parameters() if p.ndim == 2])
    return interval * lr / w.double().pow(2).mean().sqrt().item()


def test_a_far_window_on_a_concentrated_gradient_is_warned_about_and_keeps_its_schedule():
    """A far window alone does not switch (on SmolLM2 at lr 1e-4 the stale default ended ahead
    of the fresh pair): the default schedule stays, bit for bit, with one warning."""
    model, _ = model_and_data(True)
    want_travel = weight_travel(model, FAR)
    with pytest.warns(UserWarning, match=r"a window travels far \(\d\.\de-\d\d: .*keeps "
                                         r"host_betas='step' with apply_delay=4.*"
                                         r"host_betas='window', apply_delay=1"):
        got, opt = run(concentrated=True)
    st = opt.stats()["spread"]
    assert not st["spread"] and st["far"] and not st["fresh"]
    # measured before the first selection's step changes the weights (fp32 sums of squares)
    assert st["travel"] == pytest.approx(want_travel, rel=1e-5)
    assert (opt.config.host_betas, opt.config.apply_delay) == ("step", None)
    with pytest.warns(UserWarning, match="a window travels far"):
        want, ref = run(concentrated=True, fresh_if_spread=False)
    assert same(got, want)
    for o in (opt, ref):
        o.close()


def test_the_travel_takes_the_schedulers_peak_lr_not_the_warm_up_s():
    """A first selection inside a warm-up sees a fraction of the lr; the travel is judged at
    the scheduler's base lr (``initial_lr``), and at the lr itself without a scheduler."""
    def first(lr, scheduled):
        model, data = model_and_data(True)
        opt = ZenFlowOptimizer(model.named_parameters(), lr=lr, **CFG)
        if scheduled:
            torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e-3 * (s + 1))  # a slow warm-up
        want = weight_travel(model, lr)  # the weights the first selection sees
        loss(model, data[0]).backward()
        opt.step()
        st = opt.stats()["spread"]
        opt.close()
        return st, want

    with pytest.warns(UserWarning, match="a window travels far"):
        warm, want = first(FAR, scheduled=True)  # the step's lr is FAR / 1000: near
    assert warm["far"] and warm["travel"] == pytest.approx(want, rel=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        near, want = first(NEAR, scheduled=False)
    assert not near["far"] and near["travel"] == pytest.approx(want, rel=1e-5)


def test_the_share_is_measured_once_at_the_first_selection():
    _, opt = run(concentrated=False, steps=1)
    first = opt.stats()["spread"]["share"]
    assert 0.1 <= first < SPREAD_SHARE  # at least uniform's 10%
    opt.close()
    _, before = run(concentrated=False, steps=0)
    assert before.stats()["spread"] == {"share": None, "spread": None, "travel": None,
                                        "far": None, "fresh": False}
    before.close()
    _, later = run(concentrated=False)  # reselections at steps 9 and 17 change nothing
    assert later.stats()["spread"]["share"] == first
    later.close()


@pytest.mark.parametrize("cfg", [dict(fresh_if_spread=False), dict(apply_delay=4),
                                 dict(apply_delay=2)])
def test_a_stale_schedule_that_stays_on_a_spread_gradient_is_warned_about(cfg):
    with pytest.warns(UserWarning, match=r"the gradient is spread \(0\.\d\d .*"
                                         r"host_betas='window', apply_delay=1"):
        _, opt = run(concentrated=False, steps=2, **cfg)
    assert opt.config.host_betas == "step" and not opt.stats()["spread"]["fresh"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        opt.step()
    opt.close()


def test_a_stale_schedule_given_explicitly_on_a_far_window_is_warned_about_once():
    with pytest.warns(UserWarning, match=r"a window travels far \(\d\.\de-\d\d: .*"
                                         r"host_betas='window', apply_delay=1"):
        _, opt = run(concentrated=True, steps=2, apply_delay=4)
    st = opt.stats()["spread"]
    assert st["far"] and not st["spread"] and not st["fresh"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        opt.step()
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # near: nothing to say
        _, opt = run(concentrated=True, steps=2, lr=NEAR, apply_delay=4)
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fresh schedule: nothing stale to warn about
        _, opt = run(concentrated=True, steps=2, host_betas="window", apply_delay=1)
    assert opt.stats()["spread"]["far"]
    opt.close()


@pytest.mark.parametrize("cfg", [dict(host_betas="window"), dict(overlap=False),
                                 dict(update_interval=1, select_interval=8),
                                 dict(host_betas="window", apply_delay=1)])
def test_schedules_it_leaves_alone_are_not_warned_about(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, opt = run(concentrated=False, steps=2, **cfg)
    assert not opt.stats()["spread"]["fresh"] and opt.stats()["spread"]["spread"]
    assert opt.config.host_betas == cfg.get("host_betas", "step")
    opt.close()


def test_a_zero_gradient_at_the_first_selection_decides_nothing_yet():
    model, data = model_and_data(False)
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **CFG)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert opt.stats()["spread"]["share"] is None
    for x in data[:9]:  # the next selection (step 9) measures
        opt.zero_grad()
        loss(model, x).backward()
        opt.step()
    assert opt.stats()["spread"]["fresh"]
    opt.close()


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def saved_and_rebuilt(steps: int, **kw):
    """A spread run saved (model and optimizer, through a file's round trip) after ``steps``
    steps, and a new model and optimizer of the same settings that the state has not been
    loaded into yet: ``(model2, opt2, saved, data)``."""
    model, data = model_and_data(False)
    opt = ZenFlowOptimizer(model.named_parameters(), **CFG, **kw)
    for x in data[:steps]:
        loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    opt.close(finish=False)
    model2, _ = model_and_data(False, seed=5)
    model2.load_state_dict(saved["model"])
    return model2, ZenFlowOptimizer(model2.named_parameters(), **CFG, **kw), saved, data


def test_a_checkpoint_carries_the_choice_and_resumes_bit_for_bit():
    want, ref = run(concentrated=False)
    ref.close()
    model2, opt2, saved, data = saved_and_rebuilt(6, lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config-change warning: the same choice
        opt2.load_state_dict(saved["opt"])
    assert opt2.stats()["spread"]["fresh"] and opt2.config.apply_delay == 1
    for x in data[6:]:
        loss(model2, x).backward()
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    assert same([p.detach() for p in model2.parameters()], want)
    opt2.close()


def test_a_bad_value_is_refused():
    with pytest.raises(ConfigError, match="fresh_if_spread must be True or False"):
        ZenFlowOptimizer([torch.zeros(4, 4, requires_grad=True)], fresh_if_spread="yes")


def test_the_rule_flags_every_study_workload_where_the_default_schedule_loses():
    """The convergence study's rows (the tuner's store: the default schedule, every lr), the
    share the optimizer measured at its first selection on each workload
    (``bench/convergence/energy.py --json``) and each model's split weight RMS
    (``bench/convergence/drift.py --json``): every workload where the default schedule ends
    past issue 50's goals (+0.01 nats or -0.5 points for classifiers, +0.005 nats for LMs)
    measures as spread (and ``zenflow-tune diagnose``'s verdict over AdamW's first 12 steps
    says so too), so fresh_if_spread acts there (or warns), or its window travels far at the
    row's lr, so the optimizer and diagnose warn; but for the workloads named in
    :data:`UNFLAGGED`, where neither is known to flag it."""
    data = ROOT / "bench" / "convergence" / "data"
    energy = json.loads((data / "energy.json").read_text())["workloads"]
    rms = {r["workload"]: r["weight_rms"]
           for r in json.loads((data / "drift.json").read_text())["rows"].values()}
    store = json.loads((ROOT / "autotune" / "data" / "real_quality.json").read_text())
    defaults = next(e for e in store["entries"] if e["name"] == "zenflow-adaptive-dense")
    losers, flagged = [], []
    for key, r in defaults["results"].items():
        wl = key.split("@")[0]
        lm = store["workloads"][key]["kind"] == "lm"
        loses = (r["loss_delta"] > (0.005 if lm else 0.01)
                 or (not lm and r["accuracy_delta_pts"] < -0.5))
        if loses:
            losers.append(key)
            assert wl in energy, f"{wl}: no first-selection share measured (energy.py)"
            # the optimizer's own measure (fresh_if_spread, its warning), and diagnose's over
            # AdamW's first steps (its verdict): both must call it spread
            spread = (energy[wl]["first_selection_share"] < SPREAD_SHARE
                      and energy[wl]["energy_share"] < SPREAD_SHARE)
            far = wl in rms and 4 * store["workloads"][key]["lr"] / rms[wl] > TRAVEL_LIMIT
            if spread or far:
                flagged.append(key)
    assert losers, "the store has no workload where the defaults lose: the check is empty"
    # the rule's known blind spots, named (docs/quality.md): strict for every other workload,
    # and failing once one of them is flagged or stops losing
    assert set(losers) - set(flagged) == set(UNFLAGGED), \
        f"not flagged: {sorted(set(losers) - set(flagged))}, known: {sorted(UNFLAGGED)}"


UNFLAGGED: dict[str, str] = {}
"""Study workloads where the default schedule misses issue 50's goals and neither the
measured share nor the window travel flags it (none since the travel: Gemma 3 270M, the one
before, travels 2.3e-3 a window at lr 2e-5 and is warned about)."""


def test_streamed_gradients_and_the_dense_set_are_measured_alike():
    """With ``stream_grads`` the split matrices' scores come from the backward hooks and the
    dense set's from its gradients: the same share as without streaming, the same choice."""
    def share(dense=("0.*",), **cfg):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(100, 48), torch.nn.Linear(48, 48),
                                    torch.nn.Linear(48, 100))
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, min_offload_numel=64,
                               dense_params=dense, **cfg)
        x = torch.randint(0, 100, (8, 5), generator=torch.Generator().manual_seed(1))
        model(x).logsumexp(-1).mean().backward()
        opt.step()
        st = opt.stats()["spread"]
        opt.close()
        return st

    plain, streamed = share(), share(stream_grads=True, max_grad_norm=1e9)
    assert plain["share"] is not None and plain["fresh"] == streamed["fresh"]
    assert streamed["share"] == pytest.approx(plain["share"], rel=1e-5)
    split = share(dense=())  # the embedding split and ranked: the same matrix, measured alike
    assert split["share"] == pytest.approx(plain["share"], rel=1e-5)
    # the measure does not depend on the run's topk_ratio: with every column on the host (0)
    # or on the device (1) nothing is ranked, and the split matrices are measured all the same
    for ratio in (0.0, 1.0):
        for cfg in ({}, {"stream_grads": True, "max_grad_norm": 1e9}):
            alike = share(topk_ratio=ratio, **cfg)
            assert alike["share"] == pytest.approx(plain["share"], rel=1e-5), (ratio, cfg)


def test_the_share_is_the_element_weighted_mean_of_each_matrixs_top_share():
    """Counted here from the first step's gradients: per matrix, the top 10% of its column
    scores (sum of g² per column) over their sum; the mean weighted by each matrix's size
    (a 64x48 and an 8x64 matrix: a plain mean would be far off)."""
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 48, generator=g) * torch.linspace(0.1, 4.0, 48)
    y = torch.randn(16, 8, generator=g)
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, **CFG)
    (model(x) - y).pow(2).mean().backward()
    shares, sizes = [], []
    for layer in (model[0], model[2]):
        scores = layer.weight.grad.double().pow(2).sum(0)
        k = max(1, round(0.1 * scores.numel()))
        shares.append(float(scores.sort(descending=True).values[:k].sum() / scores.sum()))
        sizes.append(layer.weight.numel())
    opt.step()
    got = opt.stats()["spread"]["share"]
    opt.close()
    want = sum(n * s for n, s in zip(sizes, shares)) / sum(sizes)
    plain = sum(shares) / len(shares)
    assert abs(plain - want) > 1e-2  # the two means differ here
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("warmup", [0, 2])
def test_a_checkpoint_before_the_first_selection_measures_after_the_resume(warmup):
    """Saved before the first selection (before any step, or in warm-up), the resumed run
    measures the spread at its first selection and trains as the uninterrupted run."""
    want, ref = run(concentrated=False, warmup_steps=warmup)
    share = ref.stats()["spread"]["share"]
    ref.close()
    assert share is not None and share < SPREAD_SHARE
    model2, opt2, saved, data = saved_and_rebuilt(warmup, lr=FAR, warmup_steps=warmup)
    opt2.load_state_dict(saved["opt"])
    assert opt2.stats()["spread"]["share"] is None
    for x in data[warmup:]:
        loss(model2, x).backward()
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    st = opt2.stats()["spread"]
    got = [p.detach().clone() for p in model2.parameters()]
    opt2.close()
    assert st["share"] == share and st["fresh"]
    assert same(got, want)
