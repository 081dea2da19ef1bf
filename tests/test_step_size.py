"""The adaptive host step size (host_lr_scale="adaptive", zenflow_triton.host.step_size): its
bounds, its degenerate cases, and what it does inside the optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.host.step_size import (SAMPLE, TRUST, cap_of_sums, fraction_of_sums,
                                           multiplier, multiplier_of_sums, sample_sums)

B1, B2 = 0.9, 0.999


# The rule's parts on whole tensors, as the host job reads them (through sample_sums).
def signal_fraction(m, v, steps, beta1, beta2):
    return fraction_of_sums(sample_sums(m, m, v), steps, beta1, beta2)


def trust_cap(master, lr):
    return cap_of_sums(sample_sums(master, master, master), lr)


def adaptive_multiplier(master, m, v, n, step, beta1, beta2, lr):
    return multiplier_of_sums(sample_sums(master, m, v), n, step, beta1, beta2, lr)


def adam_moments(window_means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m and v after one Adam step per row of ``window_means`` (what the host keeps)."""
    m = torch.zeros(window_means.shape[1:])
    v = torch.zeros_like(m)
    for g in window_means:
        m.lerp_(g, 1 - B1)
        v.mul_(B2).addcmul_(g, g, value=1 - B2)
    return m, v


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_multiplier_runs_from_sqrt_n_to_n(n):
    assert multiplier(n, 1.0) == pytest.approx(n, rel=1e-12)
    assert multiplier(n, 0.0) == pytest.approx(math.sqrt(n), rel=1e-12)
    values = [multiplier(n, r / 20) for r in range(21)]
    assert values == sorted(values)  # more signal, farther
    assert all(math.sqrt(n) - 1e-12 <= c <= n + 1e-12 for c in values)
    # out-of-range fractions are clamped, never beyond the bounds
    assert multiplier(n, 7.0) == multiplier(n, 1.0)
    assert multiplier(n, -3.0) == multiplier(n, 0.0)


def test_one_gradient_per_window_is_plain_adamw():
    for rho in (0.0, 0.3, 1.0):
        assert multiplier(1, rho) == 1.0


def test_a_steady_gradient_is_signal():
    """A constant gradient: m_hat^2 = v_hat, so the window mean is all signal and the
    multiplier is n, as far as n AdamW steps go."""
    g = torch.randn(64, 32).sign() * (0.5 + torch.rand(64, 32))
    m, v = adam_moments(g.expand(10, -1, -1))
    assert signal_fraction(m, v, 10, B1, B2) == pytest.approx(1.0, abs=1e-5)
    big = torch.ones(64, 32)  # weights large against lr: the trust cap does not bind
    assert adaptive_multiplier(big, m, v, 8, 11, B1, B2, 1e-4) == pytest.approx(8.0, rel=1e-4)


@pytest.mark.parametrize("steps", [2, 5, 30])
def test_pure_noise_is_noise(steps):
    """Window means of zero-mean noise: the EMA's own noise is removed from m_hat^2, so the
    signal fraction is near 0 after any number of steps and the multiplier near sqrt(n)."""
    torch.manual_seed(steps)
    m, v = adam_moments(torch.randn(steps, 128, 256))
    rho = signal_fraction(m, v, steps, B1, B2)
    assert rho < 0.03, rho
    big = torch.ones(128, 256)
    assert adaptive_multiplier(big, m, v, 8, steps + 1, B1, B2, 1e-4) < 1.05 * math.sqrt(8)


def test_signal_plus_noise_lands_between():
    """mu^2 equal to the window mean's noise variance: rho = 1/2."""
    torch.manual_seed(0)
    mu = torch.randn(128, 256).sign()
    m, v = adam_moments(mu + torch.randn(200, 128, 256))
    assert signal_fraction(m, v, 200, B1, B2) == pytest.approx(0.5, abs=0.06)


def test_no_history_assumes_noise():
    m, v = adam_moments(torch.ones(1, 8, 8))
    assert signal_fraction(m, v, 1, B1, B2) == 0.0  # one step: m_hat^2 = v_hat, no evidence
    assert signal_fraction(torch.zeros(8, 8), torch.zeros(8, 8), 5, B1, B2) == 0.0
    assert adaptive_multiplier(torch.ones(8, 8), m, v, 4, 1, B1, B2, 1e-4) == 2.0


def test_the_trust_cap_bounds_one_step_against_the_weights():
    """c * lr at most TRUST of the weights' RMS, never below 1: a steady gradient on small
    weights at a large lr gets one ordinary step, not n."""
    w = torch.full((64, 32), 0.05)
    assert trust_cap(w, 1e-3) == 1.0                       # 0.01 * 0.05 / 1e-3 = 0.5 -> 1
    assert trust_cap(w, 1e-4) == pytest.approx(TRUST * 0.05 / 1e-4)   # 5
    assert trust_cap(w, 0.0) == math.inf                   # lr 0 (a warm-up start)
    g = torch.ones(64, 32)
    m, v = adam_moments(g.expand(10, -1, -1))
    assert adaptive_multiplier(w, m, v, 8, 11, B1, B2, 1e-3) == 1.0
    assert adaptive_multiplier(w, m, v, 8, 11, B1, B2, 1e-4) == pytest.approx(5.0)
    assert adaptive_multiplier(w, m, v, 4, 11, B1, B2, 1e-4) == pytest.approx(4.0, rel=1e-4)


def test_large_params_are_sampled_deterministically_and_bf16_moments_work():
    torch.manual_seed(1)
    m, v = adam_moments(torch.randn(6, 4 * SAMPLE + 3) + 0.5)
    a = signal_fraction(m, v, 6, B1, B2)
    assert a == signal_fraction(m.clone(), v.clone(), 6, B1, B2)
    assert 0.0 < a < 1.0
    b = signal_fraction(m.bfloat16(), v.bfloat16(), 6, B1, B2)
    assert b == pytest.approx(a, abs=0.02)


@pytest.mark.parametrize("rows,splits", [(6, [2, 4]), (7, [3]), (5, [0, 1, 5])])
def test_rows_of_a_host_half_sample_what_the_whole_samples(rows, splits):
    """Under data parallelism each rank sums the sample of its rows (``sample_sums`` with the
    rows' flat offset); the sums over the ranks are the whole host half's (the same
    elements, to float64 rounding), so the multiplier is one process's. Wide rows (a stride
    over the sample) and narrow ones (every element); a rank with no rows adds nothing."""
    torch.manual_seed(2)
    for width in (4 * SAMPLE // rows + 5, 33):
        m, v = adam_moments(torch.randn(8, rows, width) + 0.3)
        w = torch.randn(rows, width) * 0.05
        whole = sample_sums(w, m, v)
        bounds = [0, *splits, rows]
        parts = sum(sample_sums(w[a:b], m[a:b], v[a:b], a * width, rows * width)
                    for a, b in zip(bounds, bounds[1:]))
        assert parts[3] == whole[3]  # the same number of elements: the same elements
        assert parts == pytest.approx(whole, rel=1e-12)
        for lr in (1e-4, 1e-6):
            assert multiplier_of_sums(parts, 8, 9, B1, B2, lr) == pytest.approx(
                adaptive_multiplier(w, m, v, 8, 9, B1, B2, lr), rel=1e-9)


def test_the_optimizer_steps_a_steady_gradient_by_n_once_it_has_history():
    """With a constant gradient every host window is pure signal: after the first windows
    (no history: sqrt(n)) the host step moves a deferred column n AdamW steps, and stats()
    reports the multiplier."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    g = torch.randn(16, 8).sign() * (0.5 + torch.rand(16, 8))
    lr, n = 1e-3, 4  # weights of RMS ~1: the trust cap (10) does not bind
    opt = ZenFlowOptimizer([w], lr=lr, weight_decay=0.0, topk_ratio=0.0, update_interval=n,
                           overlap=False, min_offload_numel=1, host_lr_scale="adaptive")
    moves = []
    for window in range(4):
        before = w.detach().clone()
        for _ in range(n):
            w.grad = g.clone()
            opt.step()
        moves.append((w.detach() - before).abs().mean().item() / lr)
    mult = opt.stats()["host_lr_multiplier_mean"]
    opt.close()
    assert moves[0] == pytest.approx(2.0, rel=1e-3)   # sqrt(4): no history
    assert moves[1] == pytest.approx(2.0, rel=1e-3)   # one step of history: still none
    assert moves[3] == pytest.approx(4.0, rel=1e-3)   # signal: n
    assert mult == pytest.approx(4.0, rel=1e-4)


# ------------------------------------------------------------ the moments' horizon
from zenflow_triton.host.window import window_betas  # noqa: E402


def test_step_betas_decay_once_per_window():
    assert window_betas("step", 0.9, 0.999, 7, 4) == (0.9, 0.999, 8, 8)


@pytest.mark.parametrize("windows", [[4, 4, 4], [1, 1, 4, 4], [3, 1, 4, 2]])
def test_window_betas_count_gradients(windows):
    """Under "window" a window of n gradients decays by beta ** n, host_step counts the
    gradients, and the step's bias corrections equal n * k AdamW steps' (1 - beta ** G for
    G gradients so far), whatever the window sizes before."""
    host_step = 0
    for n in windows:
        b1, b2, host_step, step = window_betas("window", 0.9, 0.999, host_step, n)
        assert (b1, b2) == (0.9 ** n, 0.999 ** n)
        assert math.isclose(1 - b1 ** step, 1 - 0.9 ** host_step, rel_tol=1e-12)
        assert math.isclose(1 - b2 ** step, 1 - 0.999 ** host_step, rel_tol=1e-12)
    assert host_step == sum(windows)
    # an int step when every window so far held n gradients (torch's AdamW's kind)
    assert window_betas("window", 0.9, 0.999, 8, 4)[3] == 3
    assert isinstance(window_betas("window", 0.9, 0.999, 8, 4)[3], int)
    assert window_betas("window", 0.9, 0.999, 7, 4)[3] == 11 / 4
