"""An HF causal LM's training loss without its fp32 logits: :func:`causal_lm_loss`.

``model(input_ids, labels=labels).loss`` makes the logits of every token, ``tokens x vocab``,
and upcasts them to fp32 for the cross-entropy: 2.1 GB for 4096 tokens of Llama-3-8B's
128,256-word vocabulary, often what keeps a micro-batch off a 24 GB card.
:func:`causal_lm_loss` runs the model's decoder for its last hidden states and hands them,
the head's weight and the shifted labels to torch's ``F.linear_cross_entropy`` with
``options=LinearCrossEntropyOptions()``: the chunked path computes the logits a chunk of
tokens at a time (about 64 rows of the vocabulary's width for 4096 tokens of Llama-3-8B) and
never holds them whole. The loss is HF's: the labels shifted as HF shifts them, -100
ignored, the mean over the counted tokens (or their sum over ``num_items_in_batch``, as the
HF Trainer passes it under gradient accumulation).

It reproduces ``lm_head(last_hidden_state)`` and nothing else, so a model whose head adds a
bias, caps or scales its logits, or adds an auxiliary loss to the cross-entropy is refused
with a ``ValueError`` that names why; nothing falls back to the full logits. Needs torch
2.13 or later (``F.linear_cross_entropy``). docs/howto-24gb.md, "Cut the loss's memory".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Labels with this value count for nothing (HF's and torch's ``ignore_index``)."""

LOGIT_CHANGES = {
    "final_logit_softcapping": (None,),   # Gemma 2/3: tanh soft-capping of the logits
    "logit_scale": (None, 1, 1.0),        # Cohere: logits times logit_scale
    "logits_scaling": (None, 1, 1.0),     # Granite: logits divided by logits_scaling
    "output_router_logits": (None, False),  # MoE: a router auxiliary loss added to the loss
}
"""Config fields of HF causal LMs whose loss is not ``cross_entropy(lm_head(hidden))``, each
with the values under which it changes nothing; any other value is refused."""


def causal_lm_loss(model: Any, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None, *, chunked: bool = True,
                   num_items_in_batch: int | torch.Tensor | None = None,
                   options: Any = None, **model_kwargs: Any) -> torch.Tensor:
    """The causal-LM loss of ``model`` (an HF ``...ForCausalLM``) on ``input_ids``, as
    ``model(input_ids, attention_mask=attention_mask, labels=labels).loss`` computes it.

    ``labels``: the targets, unshifted, -100 where a token counts for nothing (None:
    ``input_ids``, with -100 where ``attention_mask`` is 0, as HF's language-modelling
    collator sets them). ``chunked``: the chunked cross-entropy, never the whole logits
    (``options``: a ``torch.nn.LinearCrossEntropyOptions``, default its defaults); False:
    the fp32 logits, as HF computes them (a reference). ``model_kwargs`` go to the decoder
    (``position_ids``...). Raises ``ValueError`` for a model it cannot reproduce."""
    head = _plain_head(model)
    decoder = _decoder(model)
    if labels is None:
        labels = input_ids if attention_mask is None else input_ids.masked_fill(
            attention_mask == 0, IGNORE_INDEX)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels have shape {tuple(labels.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}: a causal LM's labels are the input's shape")
    model_kwargs.setdefault("use_cache", False)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    target = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).long()
    target = target.to(hidden.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    reduction = "mean" if num_items_in_batch is None else "sum"
    if chunked:
        loss = F.linear_cross_entropy(hidden, head.weight, target, reduction=reduction,
                                      ignore_index=IGNORE_INDEX,
                                      options=_chunked_options(options))
    else:
        logits = F.linear(hidden, head.weight).float()
        loss = F.cross_entropy(logits, target, reduction=reduction, ignore_index=IGNORE_INDEX)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch)
                       else num_items_in_batch)
    return loss


def _plain_head(model: Any) -> Any:
    """The model's output embedding, once it is known to be a bias-free linear map whose
    logits go straight into the cross-entropy (:data:`LOGIT_CHANGES`)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__} has no output embedding with a 2-D weight "
                         "(get_output_embeddings()): causal_lm_loss needs an HF causal LM's "
                         "head")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s head has a bias: causal_lm_loss computes "
                         "hidden @ weight.T only, and would leave the bias out")
    for config in _configs(model):
        for field, neutral in LOGIT_CHANGES.items():
            value = getattr(config, field, None)
            if value not in neutral:
                raise ValueError(f"{type(model).__name__}'s config sets {field}={value!r}: the "
                                 "model changes its logits or its loss beyond the "
                                 "cross-entropy of lm_head(hidden), which causal_lm_loss "
                                 "does not reproduce")
    return head


def _configs(model: Any) -> list[Any]:
    """The model's config and, for a multimodal one, its text model's."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [config] if text is config else [config, text]


def _decoder(model: Any) -> Any:
    """The base model that returns the last hidden states (``get_decoder()``, else
    ``model.model``), never the causal LM itself (that would make the logits)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else getattr(model, "model", None)
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__}: no base model found (get_decoder() or "
                         ".model) to run for the hidden states")
    return decoder


def _chunked_options(options: Any) -> Any:
    """``options``, or torch's default chunked options; a torch without the chunked
    cross-entropy is refused, never replaced by the full logits."""
    cls = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if cls is None or not hasattr(F, "linear_cross_entropy"):
        raise ValueError(f"torch {torch.__version__} has no chunked cross-entropy "
                         "(F.linear_cross_entropy with LinearCrossEntropyOptions, torch 2.13 "
                         "or later); pass chunked=False for the fp32 logits")
    if torch.jit.is_tracing():
        raise ValueError("the chunked cross-entropy cannot be traced with torch.jit.trace "
                         "(torch would compute the whole logits instead); pass "
                         "chunked=False")
    if options is None:
        return cls()
    if not isinstance(options, cls):
        raise ValueError(f"options must be a torch.nn.LinearCrossEntropyOptions, got "
                         f"{type(options).__name__}")
    return options
