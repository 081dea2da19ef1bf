"""What a new user runs into first (issue 49): bad input that names the field, a param listed
twice, profile names in any case, the CLI's version and its short usage errors, one list of
model presets everywhere."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from autotune import cli
from autotune.stepmodel.workload import PRESETS
from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.profiles import load_profile

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kw,field", [
    (dict(lr="1e-3"), "lr"), (dict(weight_decay="0.01"), "weight_decay"),
    (dict(eps="1e-8"), "eps"), (dict(betas=0.9), "betas"), (dict(betas=("0.9", 0.999)), "betas"),
    (dict(betas="0.9,0.999"), "betas")])
def test_a_string_or_a_scalar_where_a_number_belongs_names_the_field(kw, field):
    p = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(TypeError, match=rf"defaults: {field} must be"):
        ZenFlowOptimizer([p], **kw)
    # the same in a param group (a YAML config's group), named by its index
    with pytest.raises(TypeError, match=rf"param group 0: {field} must be"):
        ZenFlowOptimizer([dict(params=[p], **kw)])


def test_numpy_numbers_are_numbers():
    p = torch.nn.Parameter(torch.zeros(8))
    ZenFlowOptimizer([p], lr=np.float32(1e-3), betas=(np.float64(0.9), 0.99)).close()


def test_a_param_listed_twice_is_refused_at_construction_naming_it():
    lin = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match="'w' .* listed twice"):
        ZenFlowOptimizer([("w", lin.weight), ("b", lin.bias), ("again", lin.weight)], lr=1e-3)


def test_profile_names_match_in_any_case():
    assert load_profile("A100-PCIE4").name == "a100-pcie4"
    with pytest.raises(LookupError, match="Did you mean 'a100-pcie4'"):
        load_profile("A100-PCIE9")


def test_the_cli_has_a_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert re.match(r"zenflow-tune \S+", capsys.readouterr().out)


def test_a_missing_config_path_says_no_such_file(capsys):
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model",
                     "/no/such/dir/config.json"]) != 0
    assert "no such file or folder: '/no/such/dir/config.json'" in capsys.readouterr().err


def test_one_list_of_presets_everywhere(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["predict", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"a model preset \(([^)]*)\)", helped).group(1)
    assert [n.strip() for n in listed.split(",")] == sorted(PRESETS)
    doc = " ".join((ROOT / "docs" / "predict.md").read_text().split())
    names = re.search(r"`--model` takes a preset \((.*?): the list", doc).group(1)
    assert sorted(re.findall(r"`([^`]+)`", names)) == sorted(PRESETS)


def test_the_default_workload_pretrains_nothing_on_a_fresh_machine(tmp_path, monkeypatch):
    # The pretrained tiny LM of the default recipe ships with the package: a fresh cache
    # (a fresh HOME, CI) loads it in a moment instead of pretraining for minutes.
    from autotune import training as W

    monkeypatch.setenv("ZENFLOW_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(W, "_pretrain_tiny_lm", lambda *a: pytest.fail("pretrained"))
    seen = []
    state = W.pretrained_tiny_lm_state(on_hit=seen.append)
    assert "ships with the package" in seen[0]
    model = W.tiny_lm_finetune(seed=0).model
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert not (tmp_path / "empty").exists()
