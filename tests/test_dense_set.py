"""The dense set (``ZenFlowConfig.dense_params``): matrices named like embeddings or the LM
head are kept whole on the device and stepped by AdamW every step, never split; which ones
is decided by name, identically on construction, step, stats and load."""

from __future__ import annotations

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.config import DEFAULT_DENSE_PARAMS, ConfigError, ZenFlowConfig

from .support.helpers import (FeedModel, GradFeed, assert_not_close, assert_trajectories_close,
                              batches, loss_fn, make_model, train_feed)

# update_interval 4, overlap: the split params' host columns lag, the dense ones do not
SPLIT = dict(min_offload_numel=64, topk_ratio=0.2, update_interval=4, host_lr_scale=1.0)
LR = 3e-3


def named(model, rename: dict[str, str]):
    """``model.named_parameters()`` with some names replaced (MixedModel's own names match
    no default pattern)."""
    return [(rename.get(n, n), p) for n, p in model.named_parameters()]


def run(opt_params, model, steps: int = 6):
    data = batches(steps)
    for x in data:
        opt_params.zero_grad()
        loss_fn(model, x).backward()
        opt_params.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_default_set_is_embeddings_and_the_lm_head():
    cfg = ZenFlowConfig()
    assert cfg.dense_params == DEFAULT_DENSE_PARAMS
    for name in ("model.embed_tokens.weight", "bert.embeddings.word_embeddings.weight",
                 "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight",
                 "Model.Embed_Tokens.weight"):
        assert cfg.is_dense(name), name
    for name in ("model.layers.0.mlp.up_proj.weight", "head.weight", "emb.weight", None, ""):
        assert not cfg.is_dense(name), name
    assert not ZenFlowConfig(dense_params=()).is_dense("lm_head.weight")
    assert ZenFlowConfig(dense_params=["fc?.weight"]).dense_params == ("fc?.weight",)


@pytest.mark.parametrize("bad", ["*embed*", ("*embed*", ""), (3,), 7])
def test_a_bad_dense_set_names_the_field(bad):
    with pytest.raises(ConfigError, match="dense_params"):
        ZenFlowConfig(dense_params=bad)


def test_a_dense_matrix_steps_exactly_like_adamw_while_the_others_lag():
    """FeedModel's last matrix named as an LM head (each param's gradient depends on itself
    only): equal to AdamW at every step, within fp32 rounding of the fused small-param AdamW
    against torch's; the other matrices, split at the same settings, lag."""
    steps = 8
    feed = GradFeed(steps)
    model, ref = FeedModel(), FeedModel()
    rename = {"ps.7": "lm_head.weight"}
    with ZenFlowOptimizer(named(model, rename), lr=LR, **SPLIT) as opt:
        train_feed(model, opt, feed)
        kinds = [opt.state[p]["kind"] for p in model.ps]
    assert kinds[7] == "small" and kinds[0] == kinds[1] == kinds[5] == "matrix"
    train_feed(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=1e-2), feed)
    got, want = [p.detach() for p in model.ps], [p.detach() for p in ref.ps]
    assert_trajectories_close(got[7:], want[7:], steps, LR)
    assert_not_close(got[:2], want[:2], steps, LR)


def test_unnamed_params_and_an_empty_set_split_every_matrix():
    for params, cfg in ((lambda m: m.parameters(), {}),
                        (lambda m: named(m, {"fc2.weight": "lm_head.weight"}),
                         dict(dense_params=()))):
        model = make_model()
        with ZenFlowOptimizer(params(model), lr=LR, **SPLIT, **cfg) as opt:
            run(opt, model, steps=1)
            assert opt.state[model.fc2.weight]["kind"] == "matrix"


def test_the_dense_set_costs_device_memory_and_saves_host_memory():
    """Kept whole on the device, a matrix's AdamW moments (8 B per element) move from the
    host to the device; stats() shows both."""
    out = {}
    for label, rename in (("split", {}), ("dense", {"head.weight": "lm_head.weight"})):
        model = make_model()
        with ZenFlowOptimizer(named(model, rename), lr=LR, **SPLIT) as opt:
            run(opt, model, steps=4)
            out[label] = opt.stats()
    numel = make_model().head.weight.numel()
    assert out["dense"]["device_state_bytes"] > out["split"]["device_state_bytes"]
    assert out["dense"]["host_state_bytes"] < out["split"]["host_state_bytes"]
    # the host half of a split head holds at least its master and moments (12 B per host
    # element, 80% of the columns); the dense one holds none of it
    assert (out["split"]["host_state_bytes"] - out["dense"]["host_state_bytes"]
            >= 12 * 0.8 * numel - 12 * make_model().head.weight.shape[0])
    assert out["dense"]["device_owned_fraction"] > out["split"]["device_owned_fraction"]


def test_a_state_dict_round_trips_and_a_changed_set_is_refused_by_name():
    rename = {"fc2.weight": "lm_head.weight"}
    model = make_model()
    with ZenFlowOptimizer(named(model, rename), lr=LR, **SPLIT) as opt:
        run(opt, model, steps=3)
        sd = opt.state_dict()
    again = make_model()
    with ZenFlowOptimizer(named(again, rename), lr=LR, **SPLIT) as opt:
        opt.load_state_dict(sd)
        assert opt.state[again.fc2.weight]["kind"] == "small"
    other = make_model()
    with ZenFlowOptimizer(named(other, rename), lr=LR, **SPLIT, dense_params=()) as opt:
        with pytest.raises(ValueError, match=r"'lm_head.weight'.*dense_params"):
            opt.load_state_dict(sd)
        assert opt.state == {} or all(st["kind"] == "matrix" for st in opt.state.values()
                                      if isinstance(st, dict) and "kind" in st)


def test_the_step_model_keeps_the_dense_set_on_the_device():
    """autotune's step model classifies like the optimizer: with the dense set, the LM head
    and embeddings leave the host's elements and join the device's AdamW state."""
    from autotune.stepmodel import PRESETS, Workload, host_update_seconds
    from autotune.stepmodel import Hardware

    wl = Workload.from_preset("llama2-7b")
    hw = Hardware(name="t", device_flops=None, device_memory_bandwidth=None,
                  link_bandwidth=None, host_cores=8, host_adam_elements_per_s=1e9,
                  accelerators_per_node=1)
    split = host_update_seconds(hw, wl, topk_ratio=0.1, dense_params=())
    dense = host_update_seconds(hw, wl, topk_ratio=0.1)
    vocab, hidden = PRESETS["llama2-7b"]["vocab"], PRESETS["llama2-7b"]["hidden"]
    cols_k = round(0.1 * hidden)
    moved = 2 * vocab * (hidden - cols_k)  # embed_tokens and lm_head, host-owned when split
    assert split - dense == pytest.approx(moved / 1e9, rel=1e-9)
