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
* the loss: the fp32 logits, ``tokens * vocab * 4`` (a fused or chunked cross-entropy
  needs less).

Upper-bound style estimates for the fit check, not a measurement; ``predict`` says so.
"""

from __future__ import annotations

from collections import Counter

from .workload import Workload


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


def activation_bytes(wl: Workload, recompute: bool = True) -> dict[str, float]:
    """The step's activation bytes on one GPU, by part (module docstring)."""
    b, t = wl.param_bytes, wl.micro_tokens
    vocab, hidden = vocab_and_hidden(wl)
    whole = [t * b * sum(p.shape[0] + p.cols for p in layer.params if len(p.shape) == 2)
             for layer in _blocks(wl)]
    if recompute:
        kept = {"activations (full recompute: block inputs + one block)":
                len(whole) * t * hidden * b + max(whole, default=0)}
    else:
        kept = {"activations (no recompute)": float(sum(whole))}
    kept["logits (fp32)"] = float(t * vocab * 4)
    return kept
