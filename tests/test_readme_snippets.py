"""The documentation's code snippets, run as they are.

Each ``<!-- snippet: NAME -->`` block is taken from README.md or a page under docs/ (the
framework recipes live in docs/frameworks.md), run in a fresh Python process (frameworks
keep global state), followed by the checks below. Framework snippets: the run resumed from
a mid-window checkpoint through the framework's own mechanism ends bit for bit where the
uninterrupted run does, and evaluation saw the applied host results. The README's usage
example, which leaves ``model`` and ``loader`` to the reader, runs after a prelude that
defines them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support.helpers import tree_env

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
FRAMEWORKS = sorted(CHECKS)  # hf-trainer, accelerate, lightning


# Names a snippet leaves to the reader, defined before it runs.
PRELUDES = {
    "usage": """
import types

import torch

torch.manual_seed(0)


class Model(torch.nn.Module):  # `model(**batch).loss`, as a transformers model gives
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 128))

    def forward(self, x, y):
        return types.SimpleNamespace(loss=torch.nn.functional.mse_loss(self.net(x), y))


model = Model()
loader = [dict(x=x, y=torch.tanh(x)) for x in torch.randn(16, 8, 128)]
""",
}

CHECKS["usage"] = """
import math
profile_opt = ZenFlowOptimizer.from_profile("a100-pcie4", model.parameters(), lr=2e-5)
assert profile_opt.config.topk_ratio > 0 and profile_opt.config.update_interval >= 1
profile_opt.close()
st = opt.stats()
assert st["steps"] == len(loader) and st["host_updates"] > 0 and not st["host_inflight"], st
assert all(torch.isfinite(p).all() for p in model.parameters())
assert math.isfinite(loss.item())
"""

CHECKS["switch"] = """
import math
steps = [adamw.state[p]["step"] for p in model.parameters()]
assert all(float(s) == 24 for s in steps), steps  # 8 + 8 + 8: the count went both ways
assert all(torch.isfinite(p).all() for p in model.parameters())
"""

# docs/howto-24gb.md, "Cut the loss's memory": a tiny Llama and one batch, the loss checked
# against HF's own to the fp32 rounding bound of tests/test_loss.py.
PRELUDES["chunked-loss"] = PRELUDES["chunked-loss-torch"] = """
import torch
from tests.test_loss import batch as _batch, loss_rounding, tiny_llama

model = tiny_llama()
ids, labels = _batch(1)
mask = torch.ones_like(ids)
mask[1, -3:] = 0
labels[1, -3:] = -100
batch = dict(input_ids=ids, labels=labels, attention_mask=mask)
"""
CHECKS["chunked-loss"] = CHECKS["chunked-loss-torch"] = """
hf = model(**batch).loss.detach()
assert abs(loss.item() - hf.item()) <= loss_rounding(model, ids, hf), (loss.item(), hf.item())
"""

# docs/howto-24gb.md, "On a 24 GB desktop": the small batch's pick written out, on a tiny
# Llama; what it sets is what the built-in desktop profile (the tuner's pick) holds.
PRELUDES["desktop-written-out"] = """
import torch
from zenflow_triton import ZenFlowOptimizer
from tests.test_loss import batch as _batch, tiny_llama

model = tiny_llama()
"""
CHECKS["desktop-written-out"] = """
import dataclasses, math
from zenflow_triton.profiles import load_profile
picked = load_profile("rtx4090-pcie4").settings
given = {k: getattr(opt.config, k) for k in ("topk_ratio", "update_interval", "accumulate_on",
         "accumulator_dtype", "host_state_dtype", "host_betas", "apply_delay", "stream_grads")}
assert given == {k: picked[k] for k in given}, (given, picked)
assert tuple(opt.config.dense_params) == tuple(picked["dense_params"]) == ()
for step in range(8):
    ids, labels = _batch(step)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
opt.synchronize()
st = opt.stats()
assert st["host_updates"] > 0 and math.isfinite(loss.item()), st
opt.close()
"""

# The pages snippets may live on: the README and every page under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text()
        for name, code in re.findall(r"<!-- snippet: ([\w-]+) -->\s*```python\n(.*?)```",
                                     text, re.S):
            assert name not in found, f"snippet {name!r} appears twice ({page.name})"
            found[name] = code
    return found


def run_snippet(name: str, tmp_path: Path) -> None:
    code = (PRELUDES.get(name, "") + "\n# ---- the snippet\n" + snippets()[name]
            + "\n# ---- checks (tests/test_readme_snippets.py)\n" + CHECKS[name])
    script = tmp_path / f"snippet_{name.replace('-', '_')}.py"  # not a package name
    script.write_text(code)
    env = tree_env(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_every_snippet_has_its_checks():
    assert set(snippets()) == set(CHECKS)


def test_the_framework_snippets_are_on_the_frameworks_page():
    text = (ROOT / "docs" / "frameworks.md").read_text()
    for name in FRAMEWORKS:
        assert f"<!-- snippet: {name} -->" in text, name


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_readme_snippet_runs_and_resumes_bit_for_bit(name, tmp_path):
    run_snippet(name, tmp_path)


def test_readme_usage_example_runs(tmp_path):
    assert "<!-- snippet: usage -->" in (ROOT / "README.md").read_text()
    run_snippet("usage", tmp_path)


def test_switching_from_adamw_and_back_runs(tmp_path):
    assert "<!-- snippet: switch -->" in (ROOT / "docs" / "howto-switch.md").read_text()
    run_snippet("switch", tmp_path)


def test_the_desktop_s_written_out_setting_is_the_tuner_s_and_trains(tmp_path):
    assert "<!-- snippet: desktop-written-out -->" in (ROOT / "docs" / "howto-24gb.md").read_text()
    run_snippet("desktop-written-out", tmp_path)


@pytest.mark.parametrize("name", ["chunked-loss", "chunked-loss-torch"])
def test_the_chunked_loss_snippets_give_hfs_loss(name, tmp_path):
    if not hasattr(__import__("torch").nn, "LinearCrossEntropyOptions"):
        pytest.skip("torch < 2.13: no chunked linear_cross_entropy")
    assert f"<!-- snippet: {name} -->" in (ROOT / "docs" / "howto-24gb.md").read_text()
    run_snippet(name, tmp_path)
