"""Clipping by the global norm (``max_grad_norm``, ``zenflow_triton.grads.clipping``).

* One micro-batch per step: the optimizer's clipping equals ``torch.nn.utils.clip_grad_norm_``
  on ``.grad`` before an unclipped step, bit for bit, on a model with bf16 matrices and fp32
  norms and biases (where the order of the per-gradient norms matters: torch takes them
  grouped by dtype), with and without gradient streaming; and the norm it reports is
  ``clip_grad_norm_``'s.
* A ``max_grad_norm`` far above the norm changes nothing: the coefficient is clamped at 1.
* The pieces: the order of the norms is torch's grouping (not the params' order), the norms
  are in the gradients' dtype, the coefficient is ``max_norm / (norm + 1e-6)``.

FSDP2 (every rank's rows, one coefficient on every rank): tests/test_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.grads import clipping

CFG = dict(topk_ratio=0.25, update_interval=2, select_interval=4, accumulate_on="host",
           min_offload_numel=256)
STEPS = 6


class Mixed(nn.Module):
    """Three blocks of a bf16 matrix (its fp32 bias beside it) and an fp32 LayerNorm, and a
    bf16 head: the layout of a bf16 model whose norms are kept in fp32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        widths = [24, 48, 40, 32]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.norms = nn.ModuleList(nn.LayerNorm(b) for b in widths[1:])
        self.head = nn.Linear(widths[-1], 8, bias=False)
        for lin in [*self.lins, self.head]:
            lin.weight.data = lin.weight.data.bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.lins, self.norms):
            x = torch.tanh(norm(F.linear(x.bfloat16(), lin.weight).float() + lin.bias))
        return F.linear(x.bfloat16(), self.head.weight).float()


def run(*, torch_clip: float | None = None, steps: int = STEPS, model_cls=Mixed, **cfg):
    """``steps`` steps on seeded batches; ``torch_clip``: ``clip_grad_norm_`` on ``.grad``
    before each step (its returned norms kept). The params, the norms reported
    (``stats()["grad_norm"]``, or clip_grad_norm_'s)."""
    model = model_cls()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **dict(CFG, **cfg))
    g = torch.Generator().manual_seed(1)
    norms = []
    try:
        for _ in range(steps):
            x, y = torch.randn(16, 24, generator=g), torch.randn(16, 8, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            if torch_clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip))
            opt.step()
            if torch_clip is None:
                norms.append(opt.stats()["grad_norm"])
            opt.zero_grad()
        opt.finish()
    finally:
        opt.close()
    return [p.detach().clone() for p in model.parameters()], norms


def assert_equal(want, got, what):
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"{what}: param {i} differs by {(a - b).abs().max().item()}"


@pytest.mark.parametrize("stream", [False, True], ids=["grad", "streamed"])
def test_one_micro_batch_clips_as_clip_grad_norm_bit_for_bit(stream):
    # 0.05 is below every step's norm here (each step is clipped: checked below).
    want, torch_norms = run(torch_clip=0.05)
    got, norms = run(max_grad_norm=0.05, stream_grads=stream)
    assert_equal(want, got, f"max_grad_norm, stream_grads={stream}")
    assert norms == [float(n) for n in torch_norms]  # the same norm, reported
    assert min(norms) > 0.05 * 2
    # and the clipping was real: unclipped, the run is another one
    free, _ = run(stream_grads=stream)
    assert any(not torch.equal(a, b) for a, b in zip(free, got))


@pytest.mark.parametrize("stream", [False, True], ids=["grad", "streamed"])
def test_a_max_norm_far_above_the_norm_changes_nothing(stream):
    # The coefficient max_norm / (norm + 1e-6) is far above 1 here; clamped at 1, the
    # gradients are multiplied by exactly 1: the run is the unclipped one, bit for bit.
    free, _ = run(stream_grads=stream)
    got, norms = run(max_grad_norm=100.0, stream_grads=stream)
    assert max(norms) < 100.0 / 10
    assert_equal(free, got, f"max_grad_norm=100, stream_grads={stream}")


def _grads(dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(int(n), generator=g) * float(s)).to(dt)
            for dt, n, s in zip(dtypes, torch.randint(1, 300, (len(dtypes),), generator=g),
                                torch.logspace(-2, 2, len(dtypes)))]


def test_the_norm_is_clip_grad_norm_s_on_mixed_dtypes_in_any_order():
    # torch groups the per-gradient norms by (device, dtype) in the order its grouping
    # gives (which is not always the first dtype seen first), then takes the norm of the
    # lot: in another order the fp32 sum of squares rounds differently. 200 lists of bf16
    # and fp32 gradients, shuffled: equal every time, where the params' order is not.
    g = torch.Generator().manual_seed(0)
    differs_in_param_order = 0
    for trial in range(200):
        dtypes = [torch.bfloat16 if b else torch.float32
                  for b in torch.rand(int(torch.randint(2, 30, (1,), generator=g)),
                                      generator=g) < 0.5]
        grads = _grads(dtypes, seed=trial)
        want = torch.nn.utils.get_total_norm(grads)
        norms = clipping.tensor_norms(grads)
        assert [n.dtype for n in norms] == [t.dtype for t in grads]
        assert torch.equal(clipping.total_norm(norms), want), trial
        in_order = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        differs_in_param_order += not torch.equal(in_order, want)
    assert differs_in_param_order > 0  # the order matters: this test can see it


def test_the_coefficient_and_the_products_are_clip_grad_norm_s():
    grads = _grads([torch.bfloat16, torch.float32, torch.bfloat16, torch.float32] * 3)
    want = [t.clone() for t in grads]
    params = [nn.Parameter(torch.zeros_like(t)) for t in want]
    for p, t in zip(params, want):
        p.grad = t
    for max_norm in (0.3, 1e4):
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        coef = clipping.coefficient(clipping.total_norm(clipping.tensor_norms(grads)), max_norm)
        assert torch.equal(coef, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        clipping.scale(grads, coef)
        assert_equal(want, grads, f"scaled by {coef.item()}")
