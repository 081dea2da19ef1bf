"""The README's framework snippets ("Using zenflow-triton with ..."), run as they are.

Each ``<!-- snippet: NAME -->`` block is taken from README.md, run in a fresh Python process
(frameworks keep global state), followed by the checks below: the run resumed from a
mid-window checkpoint through the framework's own mechanism ends bit for bit where the
uninterrupted run does, and evaluation saw the applied host results.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECKS = {
    "hf-trainer": """
import math
assert math.isfinite(metrics["eval_loss"])
assert metrics["eval_loss"] == metrics_resumed["eval_loss"], (metrics, metrics_resumed)
for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
    assert torch.equal(a, b)
assert opt.stats()["host_updates"] > 0 and not opt.stats()["host_inflight"]
""",
    "accelerate": """
assert loss_plain == loss_resumed, (loss_plain, loss_resumed)
assert all(torch.equal(a, b) for a, b in zip(params_plain, params_resumed))
""",
    "lightning": """
assert ckpt.endswith(".ckpt") and "step=8" in ckpt, ckpt
assert plain.global_step == resumed.global_step == 24
for a, b in zip(plain_module.parameters(), resumed_module.parameters()):
    assert torch.equal(a, b)
assert plain.callback_metrics["val_loss"] == resumed.callback_metrics["val_loss"]
""",
}


def snippets() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    found = dict(re.findall(r"<!-- snippet: ([\w-]+) -->\s*```python\n(.*?)```", text, re.S))
    return found


def test_every_snippet_has_its_checks():
    assert set(snippets()) == set(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_readme_snippet_runs_and_resumes_bit_for_bit(name, tmp_path):
    code = snippets()[name] + "\n# ---- checks (tests/test_readme_snippets.py)\n" + CHECKS[name]
    script = tmp_path / f"snippet_{name.replace('-', '_')}.py"  # not a package name
    script.write_text(code)
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
