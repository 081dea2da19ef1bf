"""Shared test fixtures: a small model with mixed param shapes, seeded data, run loops."""

from __future__ import annotations

import copy

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
