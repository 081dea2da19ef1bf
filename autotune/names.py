"""The names the tuner makes up: a slug of free text (study, profile and hardware names) and
the code key a default study name carries. Stored studies and saved profiles are found
again by these names, so a change here orphans them: keep the outputs stable."""

from __future__ import annotations

import re
from pathlib import Path


def slug(text: str, limit: int, *, keep: str = "._-", strip: str = "-.",
         fallback: str = "") -> str:
    """``text`` lowercased, each run of characters other than ``a-z``, ``0-9`` and ``keep``
    replaced by one ``-``, the ends stripped of ``strip``, cut to ``limit`` characters;
    ``fallback`` when nothing is left."""
    s = re.sub(f"[^a-z0-9{re.escape(keep)}]+", "-", text.lower())
    return s.strip(strip)[:limit] or fallback


def code_key() -> str:
    """8 hex digits that change with anything that changes a study's numbers: the source of
    zenflow_triton and autotune, the torch version and torch's thread count."""
    import hashlib

    import torch

    h = hashlib.sha256(f"{torch.__version__}|{torch.get_num_threads()}".encode())
    root = Path(__file__).resolve().parents[1]
    for pkg in ("zenflow_triton", "autotune"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:8]
