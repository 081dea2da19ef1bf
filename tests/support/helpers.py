"""Shared test fixtures: a small model with mixed param shapes, seeded data, run loops."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch
from torch import nn

VOCAB = 61


class MixedModel(nn.Module):
    """Embedding, Linear layers with non-power-of-two dims, biases, a LayerNorm."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 24)
        self.fc1 = nn.Linear(24, 37)
        self.norm = nn.LayerNorm(37)
        self.fc2 = nn.Linear(37, 45)
        self.head = nn.Linear(45, VOCAB, bias=False)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = torch.relu(self.norm(self.fc1(h)))
        h = torch.tanh(self.fc2(h))
        return self.head(h)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> MixedModel:
    torch.manual_seed(seed)
    return MixedModel(dtype)


def batches(n: int, seed: int = 1, batch: int = 6, seq: int = 9):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def param_groups(model: nn.Module, lr: float = 3e-3, wd: float = 0.1):
    """Two groups as fine-tuning recipes make them: decay on matrices, none on 1-D params."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd, "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr}]


def warmup_lambda(step: int) -> float:
    """LambdaLR factor: starts at 0.0 (as HF warm-up does), then decays."""
    return min(1.0, step / 3) * (0.97 ** step)


def train(model, opt, data, sched=None, zero_grad_via_model: bool = False):
    for x in data:
        if zero_grad_via_model:
            model.zero_grad()
        else:
            opt.zero_grad()
        loss_fn(model, x).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        worst = max(worst, ((x - y).abs() / (y.abs() + 1e-12)).max().item())
    return worst


def clone_model(model):
    return copy.deepcopy(model)


# ------------------------------------------------------------------ comparing implementations
# Two different implementations of the same trajectory (the library vs torch.optim.AdamW, vs
# tests/reference.py, the Triton vs the torch backend) agree only up to fp32 rounding, which
# depends on the machine's vector width and fused multiply-adds. Their comparisons run on a
# seeded gradient feed (below) and use fp32_run_tol(); bit-exact comparisons are kept for the
# same computation (thread counts, chunk sizes, save-and-resume).

EPS32 = torch.finfo(torch.float32).eps  # 2**-23: two roundings' worth of relative error

# Rounded fp32 operations in one AdamW update of one element (decay, two moment updates,
# sqrt, two bias corrections, add eps, divide, multiply-add), each off by at most EPS32/2.
ADAMW_OPS = 10


def adam_step_bound(beta1: float, beta2: float, steps: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| over ``steps`` Adam steps, whatever the
    gradients: by Cauchy-Schwarz |m| / sqrt(v) <= (1-b1) / sqrt((1-b2) (1 - b1^2/b2)), and the
    bias corrections multiply that by sqrt(1-b2^t) / (1-b1^t)."""
    assert beta1 ** 2 < beta2, "the bound needs beta1^2 < beta2"
    base = (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))
    return max(base * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
               for t in range(1, steps + 1))


def fp32_run_tol(steps: int, lr: float, betas=(0.9, 0.999)) -> dict:
    """``assert_close`` tolerances for two fp32 implementations of one AdamW trajectory of
    ``steps`` steps with bit-identical gradients, at most ``lr`` (effective, host multiplier
    included) per step; ``betas``: one pair, or a list of every group's pair.

    One step's results differ by at most ADAMW_OPS * EPS32 relative (m, v) and ADAMW_OPS * EPS32
    * (|w| + lr * R) absolute (w), R = adam_step_bound. The moments' relative error carries
    over from step to step (v's decay, beta2 ~ 1, does not shrink it over a short run), so the
    update of step t is off by at most t * ADAMW_OPS * EPS32 relative, and summing over the
    run: |dw| <= ADAMW_OPS * EPS32 * (T * |w| + T^2 * lr * R). With a gradient that depends on
    the param (the feed's pull) the difference feeds back by a factor (1 + lr * pull) per
    step, at most exp(lr * pull * T) < 2 for the runs here (lr * pull * T <= 0.6)."""
    pairs = [betas] if isinstance(betas[0], float) else list(betas)  # one pair or several
    r = max(adam_step_bound(b1, b2, steps) for b1, b2 in pairs)
    return dict(rtol=2 * ADAMW_OPS * EPS32 * steps,
                atol=2 * ADAMW_OPS * EPS32 * steps ** 2 * lr * r)


def assert_trajectories_close(got, want, steps: int, lr: float, betas=(0.9, 0.999),
                              what: str = "param") -> None:
    tol = fp32_run_tol(steps, lr, betas)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.float(), w.float(), **tol,
                                   msg=lambda m, i=i: f"{what} {i}: {m}")


def assert_not_close(got, want, steps: int, lr: float, betas=(0.9, 0.999)) -> None:
    """Guards a comparison's strength: ``got`` differs from ``want`` beyond the tolerance."""
    tol = fp32_run_tol(steps, lr, betas)
    assert any(not torch.allclose(g.float(), w.float(), **tol) for g, w in zip(got, want)), \
        "these trajectories should differ beyond fp32_run_tol"


class FeedModel(nn.Module):
    """MixedModel's param shapes (an embedding-like and three Linear-like matrices, biases,
    a norm), trained on a seeded objective instead of data (see GradFeed)."""

    SHAPES = [(VOCAB, 24), (37, 24), (37,), (37,), (37,), (45, 37), (45,), (VOCAB, 45)]

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList(
            [nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device=device, dtype=dtype))
             for s in self.SHAPES])


class GradFeed:
    """Seeded gradients for FeedModel: the loss of step t is
    sum_p 0.5 * pull * |p - target_p|^2 + <noise_{t,p}, p>, so the gradient is
    pull * (p - target_p) + noise_{t,p}, computed elementwise (no reductions: both sides of a
    comparison get bit-identical gradients from bit-identical params, and a last-bit difference
    in a param moves its gradient by pull times as much, no more).

    noise_{t,p} = s_t * col_scale_p * N(0, 1): a per-step magnitude s_t (so clipping by the
    global norm changes the trajectory) and fixed per-column scales (some columns stay
    important, as in real models; the selection still moves). ``pull`` makes the apply point
    observable: a param that lags by a window gets a different gradient. Use pull=0 for bf16
    params: a bf16 param one rounding step off would change the gradient by more than fp32
    rounding."""

    def __init__(self, steps: int, seed: int = 1, pull: float = 0.5,
                 grid: torch.dtype = torch.float32) -> None:
        """``grid``: round the noise to this dtype, so that with pull=0 a bf16 param's
        gradient and an fp32 copy's gradient hold the same numbers."""
        g = torch.Generator().manual_seed(seed)
        self.pull = pull
        self.targets = [torch.randn(s, generator=g) for s in FeedModel.SHAPES]
        scales = [torch.exp(torch.randn(s[-1], generator=g)) if len(s) >= 2 else torch.ones(())
                  for s in FeedModel.SHAPES]
        self.noise = []
        for _ in range(steps):
            s_t = math.exp(0.5 * torch.randn((), generator=g).item())
            self.noise.append([(s_t * c * torch.randn(s, generator=g)).to(grid).float()
                               for c, s in zip(scales, FeedModel.SHAPES)])
        self.batches = list(range(steps))  # a "batch" is the step's index into the feed

    def loss(self, model: FeedModel, t: int) -> torch.Tensor:
        """The step's loss on the model's device (the feed is made on the CPU, once)."""
        dev = model.ps[0].device
        total = torch.zeros((), device=dev)
        for p, target, noise in zip(model.ps, self.targets, self.noise[t]):
            w = p.float()
            total = (total + 0.5 * self.pull * (w - target.to(dev)).square().sum()
                     + (noise.to(dev) * w).sum())
        return total


def train_feed(model, opt, feed: GradFeed, sched=None, clip: float | None = None,
               steps: int | None = None, zero_grad_via_model: bool = False):
    for t in feed.batches[:steps]:
        if zero_grad_via_model:
            model.zero_grad()
        else:
            opt.zero_grad()
        feed.loss(model, t).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return model


def fp32_masters(opt, params) -> list[torch.Tensor]:
    """Each param's fp32 master as the optimizer holds it (bf16/fp16 params keep one; fp32
    params are their own), assembled from the state the optimizer shows in state_dict()."""
    out = []
    for p in params:
        st = opt.state.get(p, {})
        if st.get("kind") == "matrix":
            rows = p.shape[0]
            full = torch.empty(rows, p.numel() // rows)
            dev = st.get("device_master")
            full[:, st["device_idx"].cpu()] = (
                dev.float().cpu() if dev is not None
                else p.detach().reshape(rows, -1)[:, st["device_idx"]].float().cpu())
            full[:, st["host_idx"].cpu()] = st["host_master"].float().cpu()
            out.append(full.view(p.shape))
        elif "master" in st:
            out.append(st["master"].float().cpu())
        else:
            out.append(p.detach().float().cpu().clone())
    return out


ROOT = Path(__file__).resolve().parents[2]


def tree_env(**extra: str) -> dict[str, str]:
    """This environment for a child process, with the checkout under test first on its
    PYTHONPATH: the child imports this tree's zenflow_triton, not whatever is installed (a
    venv of another checkout would otherwise test that one)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env
