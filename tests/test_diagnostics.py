"""zenflow_triton.diagnostics: the gradient properties ZenFlow relies on, on gradients whose
answers are known, and the ``zenflow-tune diagnose`` command on the embedded workload."""

from __future__ import annotations

import json

import pytest
import torch

from zenflow_triton.diagnostics import GradientDiagnostics


def params(*shapes):
    return [(f"w{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]


def test_energy_share_is_one_when_k_columns_hold_everything_and_k_over_cols_when_even():
    named = params((8, 20), (8, 20))
    diag = GradientDiagnostics(named, topk_ratio=0.1, min_offload_numel=1)  # k = 2 of 20
    concentrated, even = named[0][1], named[1][1]
    concentrated.grad = torch.zeros(8, 20)
    concentrated.grad[:, [3, 11]] = torch.randn(8, 2)
    even.grad = torch.ones(8, 20)
    diag.record()
    rows = {r["name"]: r for r in diag.summary()["layers"]}
    assert rows["w0"]["energy_share"] == pytest.approx(1.0)
    assert rows["w1"]["energy_share"] == pytest.approx(0.1)


def test_overlap_of_consecutive_and_first_top_k_sets():
    (name, p), = params((4, 10))
    diag = GradientDiagnostics([(name, p)], topk_ratio=0.2, min_offload_numel=1)  # k = 2

    def step(cols):
        p.grad = torch.full((4, 10), 0.01)
        p.grad[:, cols] = 1.0
        diag.record()

    step([0, 1])
    step([0, 1])  # the same set: overlap 1 with previous and first
    step([1, 5])  # one of two kept: 0.5 with previous, 0.5 with first
    step([7, 8])  # none kept: 0 and 0
    layer = diag.layers[0]
    assert layer.overlap_prev == [1.0, 0.5, 0.0]
    assert layer.overlap_first == [1.0, 0.5, 0.0]
    assert diag.summary()["overall"]["overlap_prev"] == pytest.approx(0.5)


def test_only_the_params_the_optimizer_would_split_and_clear_errors():
    named = params((64, 64), (64,), (2, 2))
    diag = GradientDiagnostics(named, topk_ratio=0.1, min_offload_numel=4096)
    assert [layer.name for layer in diag.layers] == ["w0"]
    with pytest.raises(ValueError, match="no matrix param"):
        GradientDiagnostics(params((64,)), topk_ratio=0.1)
    with pytest.raises(ValueError, match="topk_ratio"):
        GradientDiagnostics(named, topk_ratio=1.0)


def test_diagnose_command_on_the_embedded_workload(tmp_path, capsys):
    from autotune.cli import main

    assert main(["diagnose", "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "energy in top-k" in out and "all (element-weighted)" in out
    summary = json.loads((tmp_path / "diagnostics.json").read_text())
    assert summary["steps"] == 3 and summary["layers"]
    share = summary["overall"]["energy_share"]
    assert summary["topk_ratio"] <= share <= 1.0  # the top-k hold at least their share
    assert main(["diagnose", "--topk-ratio", "1.5", "--out", str(tmp_path)]) == 1
    assert "\nverdict: " in out


@pytest.mark.parametrize("share,overlap,words", [
    (0.63, 0.65, "suits ZenFlow (0.63"), (0.36, 0.5, "suits ZenFlow with care"),
    (0.36, 0.5, "host_betas='window' with apply_delay=1"),
    (0.15, 0.5, "may not suit"), (0.6, 0.2, "changes from step to step")])
def test_the_verdict_follows_the_measured_thresholds(share, overlap, words):
    from zenflow_triton.diagnostics import verdict

    s = dict(topk_ratio=0.1, overall=dict(energy_share=share, overlap_prev=overlap))
    assert words in verdict(s)
    assert "topk_ratio=0.1 only" in verdict(dict(s, topk_ratio=0.2))


def test_the_verdict_flags_a_far_window_on_a_concentrated_gradient():
    """Gemma 3 270M's case: concentrated (0.62) but its weights are small for its lr, so a
    window's result may be stale when applied: the verdict says so and names the fresh
    schedule to compare with."""
    from zenflow_triton.columns.spread import TRAVEL_LIMIT
    from zenflow_triton.diagnostics import verdict

    s = dict(topk_ratio=0.1, overall=dict(energy_share=0.62, overlap_prev=0.65))
    far = verdict(s, travel=2.3 * TRAVEL_LIMIT)
    assert "a window may be stale at this lr" in far and "over 0.001" in far
    assert "compare the defaults with host_betas='window', apply_delay=1" in far
    near = verdict(s, travel=0.4 * TRAVEL_LIMIT)
    assert near.startswith("verdict: suits ZenFlow (0.62") and "under 0.001" in near
    assert "host_betas='window'" not in near
    assert "host_betas='window'" not in verdict(s)  # no lr given: the share alone


def test_window_travel_is_the_split_matrices_rms_against_the_lr():
    from zenflow_triton.columns.spread import window_travel

    named = [("layer.weight", torch.full((64, 64), 0.02)), ("layer.bias", torch.ones(64)),
             ("embed.weight", torch.full((100, 64), 5.0)),  # the dense set's: not counted
             ("small.weight", torch.ones(4, 4))]  # under min_offload_numel: not counted
    got = window_travel(named, lr=2e-5, update_interval=4)
    assert got == pytest.approx(4 * 2e-5 / 0.02, rel=1e-6)  # 0.02 in fp32
    assert window_travel(named[1:2], lr=2e-5) is None


def test_kind_table_groups_layers_by_name_without_their_numbers():
    from zenflow_triton.diagnostics import kind_table

    named = [(f"model.layers.{i}.attn.q.weight", torch.nn.Parameter(torch.zeros(4, 10)))
             for i in range(3)] + [("head.weight", torch.nn.Parameter(torch.zeros(4, 10)))]
    diag = GradientDiagnostics(named, topk_ratio=0.2, min_offload_numel=1)
    for _, p in named:
        p.grad = torch.ones(4, 10)
    diag.record()
    table = kind_table(diag.summary())
    assert "| model.layers.N.attn.q.weight | 3 | 0.20 (0.20-0.20) |" in table
    assert "| head.weight | 1 |" in table
