"""zenflow_triton.loss.causal_lm_loss: an HF causal LM's loss by torch's chunked
cross-entropy, against the fp32 logits HF computes, on a tiny LlamaForCausalLM (fp32, CPU).

Two implementations of one loss, so the comparisons are to fp32 rounding (u = 2^-24), each
bound derived where it is used; the same computation (``chunked=False``, HF's fp32 logits) is
compared bit for bit."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

from zenflow_triton import ZenFlowOptimizer, causal_lm_loss
from zenflow_triton import loss as L

from .support.helpers import fp32_run_tol

U = 2.0 ** -24          # fp32 unit roundoff
V, H, T = 1000, 64, 32  # vocabulary, hidden size, tokens per row (two rows a batch)
needs_chunked = pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyOptions"),
                                   reason="torch < 2.13: no chunked linear_cross_entropy")


def tiny_llama(seed: int = 0, **config) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=2 * T,
                                   **config)
    return transformers.LlamaForCausalLM(cfg).float()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of T tokens; the labels ignore the first 5 tokens of row 0 (a prompt)."""
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :5] = L.IGNORE_INDEX
    return ids, labels


def loss_rounding(model, ids, loss) -> float:
    """How far two fp32 evaluations of one causal-LM loss, summed in different orders, can
    lie apart: each logit is a dot product of H terms (off by at most H u A, A the largest
    sum |h_k w_ik| over tokens and vocabulary), the log-sum-exp of V of them and the mean over
    T' tokens add (V + T') u |loss|; a logit error moves the loss by at most twice itself.
    Either route is within that of the exact loss, so the two within twice that."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, H)
        a = (hidden.abs() @ model.lm_head.weight.abs().T).max().item()
    return 2 * (2 * H * a + (V + ids.numel()) * abs(float(loss))) * U


@needs_chunked
def test_the_loss_at_step_0_is_hfs_own():
    model = tiny_llama()
    ids, labels = batch(1)
    hf = model(ids, labels=labels).loss.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # torch warns when it ignores the chunked options
        chunked = causal_lm_loss(model, ids, labels)
    assert abs(chunked.item() - hf.item()) <= loss_rounding(model, ids, hf)
    assert torch.equal(causal_lm_loss(model, ids, labels, chunked=False).detach(), hf)
    # the HF Trainer's gradient accumulation: the sum over num_items_in_batch
    n = torch.tensor(100)
    hf_sum = model(ids, labels=labels, num_items_in_batch=n).loss.detach()
    assert torch.equal(causal_lm_loss(model, ids, labels, chunked=False,
                                      num_items_in_batch=n).detach(), hf_sum)
    assert abs(causal_lm_loss(model, ids, labels, num_items_in_batch=n).item()
               - hf_sum.item()) <= loss_rounding(model, ids, hf_sum)


@needs_chunked
def test_the_chunked_route_is_the_one_taken(monkeypatch):
    """chunked=True calls F.linear_cross_entropy with chunked options (never options=None,
    the whole logits), on the shifted labels; without labels, the inputs with -100 where
    the attention mask is 0."""
    seen = []
    real = F.linear_cross_entropy

    def spy(hidden, weight, target, **kw):
        seen.append((hidden.shape, target.clone(), kw["options"]))
        return real(hidden, weight, target, **kw)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    model = tiny_llama()
    ids, labels = batch(2)
    causal_lm_loss(model, ids, labels)
    (shape, target, options), = seen
    assert isinstance(options, torch.nn.LinearCrossEntropyOptions)
    assert shape == (ids.numel(), H)
    want = torch.cat([labels[:, 1:], torch.full((2, 1), L.IGNORE_INDEX)], dim=1).reshape(-1)
    assert torch.equal(target, want)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    seen.clear()
    causal_lm_loss(model, ids, attention_mask=mask)
    masked = ids.masked_fill(mask == 0, L.IGNORE_INDEX)
    assert torch.equal(seen[0][1], torch.cat([masked[:, 1:], torch.full((2, 1), -100)],
                                             dim=1).reshape(-1))


def train(route, steps: int, lr: float, eps: float, grad_bound: float):
    """``steps`` ZenFlow steps of a tiny Llama (both column owners in every block matrix, a
    host window every 2 steps, applied a window later), the loss by ``route``; the losses,
    the final params and each step's gradient 1-norm. Checks the premise of the bound that
    every gradient stays within ``grad_bound`` (at most ``eps``)."""
    model = tiny_llama()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=lr, eps=eps, weight_decay=0.0,
                           topk_ratio=0.25, update_interval=2, min_offload_numel=64)
    losses, norms = [], []
    try:
        for step in range(steps):
            ids, labels = batch(10 + step % 2)   # two batches, learnt in turn
            loss = route(model, ids, labels)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            assert max(g.abs().max().item() for g in grads) <= grad_bound <= eps
            norms.append(sum(g.abs().sum().item() for g in grads))
            losses.append(loss.item())
            opt.step()
            model.zero_grad(set_to_none=True)
        opt.finish()
    finally:
        opt.close()
    return losses, [p.detach().clone() for p in model.parameters()], norms


@needs_chunked
def test_training_through_the_chunked_loss_equals_the_fp32_logits():
    """ZenFlowOptimizer trains the same through either loss, to fp32 rounding.

    How the bound is derived. The two routes' gradients differ by the rounding of sums in
    different orders: at most K u G per element, K = V (the longest sum, the log-sum-exp over
    the vocabulary, which every gradient passes through) and G the bound on every gradient
    (checked each step). Adam's eps is set at or above G so its update m/(sqrt(v) + eps)
    is Lipschitz in the gradients (by at most 1/eps + G/eps^2 <= 2/eps per unit change of
    m or sqrt(v), each within K u G of the other route's): a rounding-level difference stays
    rounding-level instead of being divided by a gradient near zero. Over N steps at most
    lr per step (the host's window step included), with the params' own difference fed
    back into the gradients at most doubling it (the helpers' argument), the params differ by
    at most 2 N lr (2/eps) K u G, plus the optimizer's own rounding (fp32_run_tol). The
    losses then differ by the step-0 rounding plus |g|_1 times the params' difference."""
    steps, lr, eps, G = 6, 0.1, 1.0, 0.5

    def hf(model, ids, labels):
        return model(ids, labels=labels).loss

    want_losses, want, norms = train(hf, steps, lr, eps, G)
    got_losses, got, _ = train(causal_lm_loss, steps, lr, eps, G)
    assert want_losses[-1] < want_losses[0]            # it trained
    moved = max((w - p).abs().max().item() for w, p in zip(want, tiny_llama().parameters()))
    assert moved > 100 * 2 * steps * lr * (2 / eps) * V * U * G   # the bound sees a step
    tol = fp32_run_tol(steps, lr)
    atol = 2 * steps * lr * (2 / eps) * V * U * G + tol["atol"]
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=tol["rtol"], atol=atol,
                                   msg=lambda m, i=i: f"param {i}: {m}")
    model = tiny_llama()
    ids, labels = batch(10)
    step0 = loss_rounding(model, ids, want_losses[0])
    for t, (g, w) in enumerate(zip(got_losses, want_losses)):
        assert abs(g - w) <= step0 + norms[t] * atol, f"step {t}: {g} vs {w}"


# ---- what it refuses ------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("final_logit_softcapping", 30.0),
                                         ("logit_scale", 0.0625),
                                         ("logits_scaling", 8.0),
                                         ("output_router_logits", True)])
def test_a_model_that_changes_its_logits_is_refused(field, value):
    model = tiny_llama()
    setattr(model.config, field, value)
    ids, labels = batch(3)
    with pytest.raises(ValueError, match=field):
        causal_lm_loss(model, ids, labels)
    for neutral in L.LOGIT_CHANGES[field]:
        setattr(model.config, field, neutral)
        causal_lm_loss(model, ids, labels, chunked=False)   # the neutral value passes


def test_a_head_with_a_bias_is_refused():
    model = tiny_llama()
    model.lm_head = torch.nn.Linear(H, V, bias=True)
    with pytest.raises(ValueError, match="bias"):
        causal_lm_loss(model, *batch(3))


def test_a_model_without_a_head_or_a_decoder_is_refused():
    model = tiny_llama()
    with pytest.raises(ValueError, match="output embedding"):
        causal_lm_loss(model.model, *batch(3))        # the base model: no head
    model.get_decoder = lambda: model
    with pytest.raises(ValueError, match="no base model"):
        causal_lm_loss(model, *batch(3))
    ids, labels = batch(3)
    with pytest.raises(ValueError, match="labels have shape"):
        causal_lm_loss(tiny_llama(), ids, labels[:, 1:])


def test_a_torch_without_the_chunked_loss_is_refused_not_replaced(monkeypatch):
    monkeypatch.delattr(torch.nn, "LinearCrossEntropyOptions", raising=False)
    model = tiny_llama()
    with pytest.raises(ValueError, match="no chunked cross-entropy"):
        causal_lm_loss(model, *batch(3))
    causal_lm_loss(model, *batch(3), chunked=False)   # the fp32 logits, asked for


@needs_chunked
def test_options_of_another_type_are_refused():
    with pytest.raises(ValueError, match="LinearCrossEntropyOptions"):
        causal_lm_loss(tiny_llama(), *batch(3), options={"batch_chunk_size": 8})
