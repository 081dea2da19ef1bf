"""A built-in profile's hardware with settings pinned for a test: tests that use a profile as a
fixture (fit checks, the step model's leaner settings) should not change meaning each time
``bench/regenerate_profiles.py`` picks new settings for it."""

from __future__ import annotations

import json
from pathlib import Path

from zenflow_triton.profiles import PROFILE_DIR_ENV, builtin_profile_dir

A100_SETTINGS = {"topk_ratio": 0.1, "update_interval": 16, "select_interval": 256,
                 "overlap": True, "warmup_steps": 0, "chunk_size": 4194304, "host_threads": None,
                 "host_lr_scale": "adaptive",
                 "dense_params": ["*embed*", "*lm_head*", "*wte*", "*wpe*"]}
"""``a100-pcie4``'s settings until 2026-12-06 (the tiny LM's verdict): the dense set, 0.1 x 16."""


def pin_profile(monkeypatch, tmp_path: Path, name: str = "a100-pcie4",
                settings: dict | None = None) -> None:
    """A user profile ``name`` (a user profile wins over the built-in) with the built-in's
    hardware and ``settings`` (default :data:`A100_SETTINGS`), in a profile dir of the test's."""
    doc = json.loads((builtin_profile_dir() / f"{name}.json").read_text(encoding="utf-8"))
    doc["settings"] = dict(settings or A100_SETTINGS)
    doc["provenance"] = {"source": "measured", "measured": False,
                         "note": "pinned for a test (tests/support/profiles.py)"}
    folder = tmp_path / "pinned-profiles"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setenv(PROFILE_DIR_ENV, str(folder))
