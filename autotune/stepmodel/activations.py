"""Activation memory of one training step on the device, the fit check's other half.

Per GPU, for the ``tokens`` of one micro-batch (one forward and backward pass; the whole step
without gradient accumulation) in the model's dtype (``b`` bytes):

* a block (a layer with two or more weight matrices) kept whole for backward holds each
  matmul's input and output: ``tokens * sum(rows + cols of its matrices) * b``; norms,
  activation functions and flash attention add little beside those (flash attention keeps
  no ``seq x seq`` scores);
* with full recompute (activation checkpointing, what a 7-8B fine-tune on one card uses)
  each block keeps only its input, ``tokens * hidden * b``, and one block's whole set is
  live again while its backward recomputes it;
* the loss (``Workload.loss``): with ``logits`` (an HF causal LM's forward) the fp32 logits,
  ``tokens * vocab * 4``; with ``chunked`` (a chunked cross-entropy, :func:`chunked_loss_bytes`)
  one chunk of logits at a time and the hidden states' gradient, a few tens of MB where the
  logits of 4096 tokens of a 128k vocabulary are 2.1 GB.

Upper-bound style estimates for the fit check, not a measurement; ``predict`` says so.
"""

from __future__ import annotations

from collections import Counter

from .inputs import DTYPE_BYTES
from .workload import Workload

LOSS_CHUNK_DIVISOR = 2
"""The chunk size the chunked loss assumes: torch's ``F.linear_cross_entropy`` with
``options=LinearCrossEntropyOptions()`` resolves ``chunking_method="auto"`` to
``"aspect_ratio:2"`` for bf16 and fp16 inputs on CUDA (and for any pair it does not list):
the chunk's ``(rows, vocab)`` logits are sized to match half the ``(tokens, hidden)`` input
(torch 2.13, ``torch/nn/modules/linear_cross_entropy_options.py``, ``_AUTO_DEFAULTS`` and
``chunking_method``'s docstring); :func:`loss_chunk_tokens`."""

CHUNK_LOGIT_BYTES = {"bfloat16": 4 + 2, "float16": 2, "float32": 4}
"""Bytes per logit of one chunk, by the model's dtype, as torch's chunked path keeps them on
CUDA (its ``"compact"`` policy, the default there): bf16 upcasts a chunk's logits to fp32 for
the softmax and keeps a bf16 copy for the gradient matmuls; fp16 keeps them in fp16; fp32 in
fp32."""


def _blocks(wl: Workload):
    return [layer for layer in wl.layers
            if sum(len(p.shape) == 2 for p in layer.params) >= 2
            and not any("embed" in p.name for p in layer.params)]


def vocab_and_hidden(wl: Workload) -> tuple[int, int]:
    """The vocabulary (rows of the embedding, or of the largest matrix) and the hidden size
    (the most common column count of the blocks' matrices)."""
    mats = [p for p in wl.params if len(p.shape) == 2]
    if not mats:
        return 0, 0
    embeds = [p for p in mats if "embed" in p.name or "lm_head" in p.name]
    vocab = max(p.shape[0] for p in (embeds or mats))
    cols = Counter(p.cols for layer in _blocks(wl) for p in layer.params if len(p.shape) == 2)
    hidden = cols.most_common(1)[0][0] if cols else max(p.cols for p in mats)
    return vocab, hidden


def loss_chunk_tokens(tokens: int, hidden: int, vocab: int,
                      divisor: int = LOSS_CHUNK_DIVISOR) -> int:
    """Tokens (rows) of one chunk of the chunked loss: ``tokens`` over ``ceil(vocab /
    hidden)``, rounded up to a power of two, over ``divisor`` (:data:`LOSS_CHUNK_DIVISOR`),
    at least 1 and at most ``tokens``. 64 for 4096 tokens of Llama-3-8B (vocab 128256,
    hidden 4096)."""
    per_row = -(-vocab // max(hidden, 1))
    rows = -(-tokens // per_row)
    power = 1 << (rows - 1).bit_length()
    return max(1, min(power // divisor, tokens))


def chunked_loss_bytes(wl: Workload) -> float:
    """The chunked loss's live bytes for one micro-batch: one chunk's logits
    (:func:`loss_chunk_tokens` rows x vocab x :data:`CHUNK_LOGIT_BYTES`) and the gradient of
    the head's input (``tokens x d x b``, ``d`` the head's input features, :func:`head_shape`),
    which torch's chunked op computes in the forward and keeps until the backward. The head's
    weight gradient it computes there too is the one the head gets in the backward anyway,
    counted with the gradients, not here."""
    vocab, d = head_shape(wl)
    t = wl.micro_tokens
    chunk = loss_chunk_tokens(t, d, vocab)
    return float(chunk * vocab * CHUNK_LOGIT_BYTES[wl.dtype] + t * d * DTYPE_BYTES[wl.dtype])


def head_shape(wl: Workload) -> tuple[int, int]:
    """The LM head's ``(vocab, input features)``: the vocabulary of :func:`vocab_and_hidden`
    and the columns of a matrix with that many rows (the head, or the embedding it is tied
    to: OPT-350m's head reads 512 features, not the blocks' 1024)."""
    vocab, hidden = vocab_and_hidden(wl)
    cols = [p.cols for p in wl.params if len(p.shape) == 2 and p.shape[0] == vocab]
    return vocab, (cols[-1] if cols else hidden)


def activation_bytes(wl: Workload, recompute: bool = True) -> dict[str, float]:
    """The step's activation bytes on one GPU, by part (module docstring); the loss's entry
    by ``wl.loss``: ``"logits (fp32)"`` or ``"logits (chunked cross-entropy)"``."""
    b, t = wl.param_bytes, wl.micro_tokens
    vocab, hidden = vocab_and_hidden(wl)
    whole = [t * b * sum(p.shape[0] + p.cols for p in layer.params if len(p.shape) == 2)
             for layer in _blocks(wl)]
    if recompute:
        kept = {"activations (full recompute: block inputs + one block)":
                len(whole) * t * hidden * b + max(whole, default=0)}
    else:
        kept = {"activations (no recompute)": float(sum(whole))}
    if wl.loss == "chunked":
        kept["logits (chunked cross-entropy)"] = chunked_loss_bytes(wl)
    else:
        kept["logits (fp32)"] = float(t * vocab * 4)
    return kept
