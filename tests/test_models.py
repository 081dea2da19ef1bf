"""The user's model and card wherever the tuner names them (issue "Fit my GPU", first part):
presets for the models people fine-tune now, an HF config.json (file or folder),
module:function, a profile read from a path and a device-memory override."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from autotune import cli
from autotune import modelled as MD
from autotune import stepmodel as S

from tests.support.profiles import pin_profile


@pytest.fixture(autouse=True)
def _pinned_a100(monkeypatch, tmp_path):
    """``a100-pcie4`` as these tests were written against (0.1 x 16 with the dense set),
    whatever bench/regenerate_profiles.py picks for the built-in."""
    pin_profile(monkeypatch, tmp_path)

transformers = pytest.importorskip("transformers")

# The published architectures (each model's config.json), as transformers builds them.
CONFIGS = {
    "llama3-8b": lambda: transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, tie_word_embeddings=False),
    "llama3-70b": lambda: transformers.LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, tie_word_embeddings=False),
    "mistral-7b": lambda: transformers.MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        tie_word_embeddings=False),
    "qwen2.5-7b": lambda: transformers.Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        tie_word_embeddings=False),
    "qwen3-0.6b": lambda: transformers.Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=True),
    "qwen3-14b": lambda: transformers.Qwen3Config(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=False),
}


@pytest.mark.parametrize("preset,published,rel", [
    ("llama3-8b", 8_030_261_248, 1e-3), ("llama3-70b", 70.55e9, 1e-3),
    ("mistral-7b", 7.24e9, 1e-3), ("qwen2.5-7b", 7.62e9, 1e-3),
    # the Qwen3 model cards give 0.6B and 14.8B: within half their last digit
    ("qwen3-0.6b", 0.6e9, 0.05 / 0.6), ("qwen3-14b", 14.8e9, 0.05 / 14.8)])
def test_new_presets_have_the_published_parameter_counts(preset, published, rel):
    assert S.Workload.from_preset(preset).numel == pytest.approx(published, rel=rel)


@pytest.mark.parametrize("preset", sorted(CONFIGS))
def test_new_presets_match_transformers_on_the_meta_device(preset, tmp_path):
    """Each preset against its config.json, loaded the way a user's is (from_spec on the
    file): the same param shapes and the same FLOPs per token, attention included."""
    path = tmp_path / "config.json"
    CONFIGS[preset]().to_json_file(str(path))
    want = S.Workload.from_preset(preset, tokens=2048)
    got = S.Workload.from_spec(str(path), tokens=2048)
    assert got.numel == want.numel
    assert sorted(p.shape for p in got.params) == sorted(p.shape for p in want.params)
    assert got.flops_per_token == pytest.approx(want.flops_per_token, rel=1e-12)
    assert S.Workload.from_spec(str(tmp_path), tokens=2048).numel == want.numel  # the folder


def test_a_config_that_is_not_a_model_is_named(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(S.StepModelError, match="config.json"):
        S.Workload.from_spec(str(bad))
    with pytest.raises(S.StepModelError, match="preset.*config.json.*module:function"):
        S.Workload.from_spec("llama-3-8b")


def test_module_function_gives_the_users_own_model(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def small():\n"
        "    with torch.device('meta'):\n"
        "        return torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 64))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wl = S.Workload.from_spec("mymodels:small", tokens=512)
    assert wl.numel == 1000 * 64 + 64 * 64 + 64 and wl.tokens == 512
    with pytest.raises(S.StepModelError, match="cannot call nothere"):
        S.Workload.from_spec("mymodels:nothere")
    sys.modules.pop("mymodels", None)


def test_device_memory_override_and_a_profile_from_a_path(tmp_path):
    forty = MD.profile_of("a100-pcie4", 40)
    assert forty.name == "a100-pcie4-40gb" and forty.hardware["device_memory_gb"] == 40
    assert S.Hardware.from_profile(forty).device_memory_bytes == 40e9
    assert MD.profile_of("a100-pcie4").hardware["device_memory_gb"] == 80  # untouched
    with pytest.raises(MD.ModelledError, match="> 0"):
        MD.profile_of("a100-pcie4", 0)
    doc = MD.profile_of("a100-pcie4").to_dict()
    doc["name"], doc["hardware"]["device_memory_gb"] = "my-card", 24
    path = tmp_path / "my-card.json"
    path.write_text(json.dumps(doc))
    mine = MD.profile_of(str(path))
    assert mine.name == "my-card" and S.Hardware.from_profile(mine).device_memory_bytes == 24e9


def test_cli_predict_on_a_users_config_and_card(tmp_path, capsys):
    """`zenflow-tune predict --profile a100-pcie4 --device-memory-gb 40 --model config.json`
    (Llama-3-8B): the 8.03B-param table on a 40 GB card, which ZenFlow's defaults overflow."""
    path = tmp_path / "config.json"
    CONFIGS["llama3-8b"]().to_json_file(str(path))
    assert cli.main(["predict", "--profile", "a100-pcie4", "--device-memory-gb", "40",
                     "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(8.03B params" in out and "a100-pcie4-40gb" in out
    assert "the device has 40 GB" in out
    assert cli.main(["predict", "--profile", "a100-pcie4", "--device-memory-gb", "-1",
                     "--model", "llama3-8b"]) == cli.EXIT_USAGE
    assert "--device-memory-gb" in capsys.readouterr().err
    assert cli.main(["run", "--device-memory-gb", "40", "--no-profile", "--quick"]) == cli.EXIT_USAGE
    assert "only with --objective modelled" in capsys.readouterr().err


def test_fitting_zenflow_gives_up_least_and_says_when_nothing_can(capsys):
    a100, wl = S.Hardware.from_profile(MD.profile_of("a100-pcie4")), \
        S.Workload.from_preset("llama3-8b")
    cfg = S.zenflow_config(MD.profile_of("a100-pcie4").settings)
    # 80 GB, activations of 4096 tokens counted: the window summed on the device does not
    # fit; summed on the host it does, and nothing else is given up
    assert not S.predict(a100, wl, "zenflow", config=cfg).fits
    roomy = S.fitting_zenflow(a100, wl, config=cfg)
    assert S.lean_changes(roomy, cfg) == {"accumulate_on": "host"}
    forty = S.Hardware.from_profile(MD.profile_of("a100-pcie4", 40))
    lean = S.fitting_zenflow(forty, wl, config=cfg)
    assert lean.fits and lean.device_memory_bytes <= 40e9 * (1 - S.DEVICE_HEADROOM)
    # on 40 GB the gradient must leave the device during backward; the dense set then stays
    # at the lowest topk_ratio (it is given up after topk_ratio)
    assert lean.settings["stream_grads"] and lean.settings["accumulate_on"] == "host"
    no_stream = [S.predict(forty, wl, "zenflow", config=cfg.replace(
        accumulate_on="host", dense_params=(), topk_ratio=0.01, accumulator_dtype=dt))
        for dt in ("float32", "bfloat16")]
    assert not any(p.fits for p in no_stream)  # the whole gradient beside the params: no
    tight = S.Hardware.from_profile(MD.profile_of("a100-pcie4", 20))
    assert S.fitting_zenflow(tight, wl, config=cfg) is None
    largest = max(p.numel for p in wl.params if len(p.shape) == 2)
    acts = sum(S.activation_bytes(wl).values())
    assert S.params_and_grads_bytes(wl) == int((wl.numel + 2 * largest) * 2 + acts)
    assert acts == pytest.approx(4096 * 128256 * 4 + 32 * 4096 * 4096 * 2
                                 + 4096 * 2 * (2 * 4096 + 2 * (1024 + 4096) + 2 * 4096
                                               + 3 * (14336 + 4096)), rel=1e-12)

    assert cli.main(["predict", "--profile", "a100-pcie4", "--device-memory-gb", "40",
                     "--model", "llama3-8b"]) == 0
    assert "fits: zenflow with accumulate_on='host'" in capsys.readouterr().out
    assert cli.main(["predict", "--profile", "a100-pcie4", "--device-memory-gb", "20",
                     "--model", "llama3-8b"]) == 0
    assert "nothing fits" in capsys.readouterr().out
    # the desktop profile's settings with fp32 host moments: the fp32 logits of 4096 tokens
    # leave no room on the device, and the host needs bf16 moments: micro-batches of 2048
    # with them fit
    assert cli.main(["predict", "--profile", "rtx4090-pcie4", "--model", "llama3-8b",
                     "--host-state-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert ("fits: zenflow with host_state_dtype='bfloat16' in micro-batches of 2048 tokens"
            in out), out[-3000:]
    assert "peer (published, not modelled): torchtune" in out


def test_predict_takes_the_desktop_profile_s_host_memory_unless_told(capsys):
    """rtx4090-pcie4 assumes a 128 GB desktop (its hardware's host_memory_gb): predict checks
    the host against it when --host-memory-gb is not given, and against the given figure
    when it is."""
    from autotune import stepmodel as S
    assert S.Hardware.from_profile("rtx4090-pcie4").host_memory_bytes == 128e9
    argv = ["predict", "--profile", "rtx4090-pcie4", "--model", "llama3-8b", "--tokens", "2048",
            "--topk-ratio", "0.01", "--update-interval", "4", "--dense-params",
            "--host-state-dtype", "float32"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "zenflow: does not fit the host" in out and "the host has 128 GB" in out
    assert cli.main(argv + ["--host-memory-gb", "512"]) == 0
    out = capsys.readouterr().out
    assert "does not fit the host" not in out and "the host has 128 GB" not in out
    assert cli.main(argv + ["--host-memory-gb", "64"]) == 0
    assert "the host has 64 GB" in capsys.readouterr().out
