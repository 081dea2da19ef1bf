"""The step model at the batch users train with: micro-batches (what the device holds
activations for at once) and tokens per optimizer step (the compute of a step), each mode's
gradient accumulation as its code runs it, worked by hand on one-layer workloads."""

from __future__ import annotations

import json

import pytest

from autotune import cli
from autotune import stepmodel as S
from tests.support.stepmodel import toy_hardware
from autotune.stepmodel.modes import zenflow_split


hw = toy_hardware


def one_layer(tokens=120, micro=None, small=1000) -> S.Workload:
    params = (S.ParamSpec("w", (1000, 2000)),) + ((S.ParamSpec("b", (small,)),) if small else ())
    return S.Workload("one", (S.Layer("l0", params, 6 * 2e6),), tokens=tokens, mfu=0.5,
                      micro_batch_tokens=micro)


def test_micro_batches_count_the_passes_of_a_step():
    assert one_layer(120).micro_batches == 1
    assert one_layer(120, micro=40).micro_batches == 3
    assert one_layer(120, micro=50).micro_batches == 3      # 50 + 50 + 20
    assert one_layer(120, micro=40).micro_tokens == 40
    for bad in (0, 121, 2.5, True):
        with pytest.raises(S.StepModelError, match="micro_batch_tokens"):
            one_layer(120, micro=bad)


def test_activations_are_those_of_one_micro_batch():
    step = S.activation_bytes(one_layer(120, micro=40))
    assert step == S.activation_bytes(one_layer(40))
    assert step != S.activation_bytes(one_layer(120))


@pytest.mark.parametrize("mode", ["adamw", "state-swap"])
def test_modes_that_sum_on_the_device_take_the_compute_of_the_whole_step(mode):
    """AdamW and state-swap: autograd sums the micro-batches' gradients in .grad on the
    device; the optimizer runs once per step, so only the compute is spread."""
    one = S.predict(hw(), one_layer(120), mode, update_interval=1)
    three = S.predict(hw(), one_layer(120, micro=40), mode, update_interval=1)
    assert three.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
    assert three.link_bytes_per_step == one.link_bytes_per_step


@pytest.mark.parametrize("M", [1, 2, 3])
def test_zero_offload_sends_the_gradient_sum_up_and_down_during_each_backward(M):
    """DeepSpeed ZeRO-1/2 offload keeps the micro-batches' gradient sum in pinned host
    memory: each backward after the first brings it up, each before the last sends the new
    sum down; the device waits for them at the end of that backward. Then the step as with
    one micro-batch."""
    h, wl = hw(), one_layer(120, micro=120 // M)
    p = S.predict(h, wl, "zero-offload", update_interval=1)
    C = 6 * 2e6 * 120 / (0.5 * 1e12)
    F, B = C / 3, 2 * C / 3
    x = 2e6 * 2 / 1e9                       # one bf16 gradient over the 1 GB/s link
    small, host = 1000 * 28 / 1e11, 2e6 / 1e9
    passes = 0.0
    for j in range(M):
        link = x * ((j > 0) + (j < M - 1))  # up the sum (after the first), down (before last)
        passes += F / M + max(B / M, link)
    assert p.step_time_s == pytest.approx(passes + small + x + host + x, rel=1e-12)
    assert p.link_down_bytes_per_step == M * 2e6 * 2
    assert p.link_up_bytes_per_step == M * 2e6 * 2
    one = S.predict(h, one_layer(120), "zero-offload", update_interval=1)
    sum_bytes = p.host_memory_bytes - one.host_memory_bytes   # the pinned gradient sum
    assert sum_bytes == (2e6 * 2 if M > 1 else 0)


def test_many_micro_batches_hide_the_delayed_host_update():
    """With a one-step delayed update the host AdamW runs beside the next step: once a
    step's compute exceeds it, the host is hidden and the step is compute and the gradient
    sum's round trips (shorter than a backward here)."""
    h = hw(host_adam_elements_per_s=2e8,    # a 10 ms host job; a 0.4 ms gradient copy
           link_bandwidth=1e10)
    short = S.predict(h, one_layer(120), "zero-offload-dpu", update_interval=1)
    long = S.predict(h, one_layer(120 * 64, micro=120), "zero-offload-dpu", update_interval=1)
    assert short.stall_fraction > 0.5
    assert long.stall_fraction < short.stall_fraction / 4


def test_steps_inside_backward_refuse_accumulation():
    p = S.predict(hw(), one_layer(120, micro=60), "overlapped-offload", update_interval=1)
    assert not p.fits and p.step_time_s is None and p.modelled_step_time_s is None
    assert "accumulate" in p.notes[0]
    assert S.predict(hw(), one_layer(120), "overlapped-offload", update_interval=1).fits


@pytest.mark.parametrize("M", [1, 4])
def test_zenflow_link_bytes_per_step_by_where_the_window_is_summed(M):
    """Device accumulation: the window's mean goes down once a window (bf16). Host
    accumulation: the host columns of .grad go down once a step, however many micro-batches
    autograd summed. Streaming: every backward sends its host columns down."""
    wl = one_layer(120, micro=120 // M, small=0)
    k = zenflow_split(wl, S.zenflow_config(topk_ratio=0.1))
    hb = k[1] * 2                            # host-owned elements, bf16
    base = dict(topk_ratio=0.1, update_interval=4, dense_params=())
    dev = S.predict(hw(), wl, "zenflow", **base, accumulate_on="device")
    host = S.predict(hw(), wl, "zenflow", **base, accumulate_on="host")
    stream = S.predict(hw(), wl, "zenflow", **base, accumulate_on="host", stream_grads=True)
    assert dev.link_down_bytes_per_step == pytest.approx(hb / 4)
    assert host.link_down_bytes_per_step == pytest.approx(hb)
    assert stream.link_down_bytes_per_step == pytest.approx(M * hb)
    for p in (dev, host, stream):            # the result goes up once a window
        assert p.link_up_bytes_per_step == pytest.approx(hb / 4)


def test_streamed_micro_batches_send_before_the_step_ends():
    """Streamed, a step of several micro-batches puts each backward's host columns on the
    link and the host accumulator, one transfer and one add per micro-batch."""
    wl = one_layer(120, micro=30, small=0)
    p = S.predict(hw(), wl, "zenflow", topk_ratio=0.1, update_interval=2, dense_params=(),
                  accumulate_on="host", stream_grads=True)
    adds = [s for s in p.timeline if s.label == "host accumulate"]
    assert len(adds) == 2 * 4                # two steps of four micro-batches


def test_a_large_batch_runs_in_micro_batches_that_fit(capsys):
    """131072 tokens per step on an 80 GB A100: no mode holds them at once, each runs the
    largest micro-batch that fits (at most 4096), and ZenFlow and ZeRO-Offload with a
    delayed update both get a step time."""
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model", "llama3-8b", "--tokens",
                     "131072", "--json", "--no-curve"]) == 0
    out = json.loads(capsys.readouterr().out)
    for mode in ("zenflow", "zero-offload-dpu"):
        assert out[mode]["fits"] and out[mode]["step_time_s"] > 0
        assert (out[mode]["micro_batches"], out[mode]["micro_batch_tokens"]) == (32, 4096)
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model", "llama3-8b", "--tokens",
                     "131072", "--micro-batch-tokens", "2048", "--json", "--no-curve"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["zenflow"]["micro_batches"] == 64
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model", "llama3-8b", "--tokens",
                     "1024", "--micro-batch-tokens", "2048"]) == cli.EXIT_USAGE
    assert "exceeds --tokens" in capsys.readouterr().err


def test_predict_prints_the_speedup_as_a_curve_over_the_batch(capsys):
    assert cli.main(["predict", "--profile", "a100-pcie4", "--model", "opt-350m"]) == 0
    text = capsys.readouterr().out
    assert "fastest peer that fits" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 4k", "| 16k", "| 64k",
                                                                     "| 256k"))]
    assert len(rows) == 4


def test_the_curve_names_the_fastest_peer_and_its_ratio():
    h = hw(device_memory_bytes=None)
    pts = S.batch_curve(h, one_layer(120), config=S.zenflow_config(
        topk_ratio=0.1, update_interval=4, dense_params=()), tokens=(120, 120 * 8))
    for pt in pts:
        peers = {m: S.predict_fitting(h, one_layer(pt.tokens), m, update_interval=4,
                                      topk_ratio=0.1, dense_params=())
                 for m in S.batch.PEERS}
        best = min(peers, key=lambda m: peers[m].step_time_s)
        assert pt.peer == best
        assert pt.speedup == pytest.approx(peers[best].step_time_s / pt.zenflow.step_time_s)
    assert "ZenFlow is" in S.verdict(pts)


def _row(throughput, topk, interval, **more):
    from types import SimpleNamespace
    return SimpleNamespace(throughput=throughput, prediction=SimpleNamespace(
        settings={"topk_ratio": topk, "update_interval": interval, **more}))


def test_the_tuner_takes_the_shortest_window_where_speed_is_free():
    from autotune.modelled import SPEED_TOLERANCE, quality_first
    fastest = _row(1000.0, 0.02, 8)
    near_short = _row(1000.0 * (1 - SPEED_TOLERANCE) + 1, 0.1, 2)
    near_more_columns = _row(990.0, 0.2, 2)
    too_slow = _row(1000.0 * (1 - SPEED_TOLERANCE) - 1, 0.1, 1)
    rows = [fastest, near_more_columns, near_short, too_slow]   # fastest first
    assert quality_first(rows) is near_more_columns   # interval 2, the larger topk_ratio
    assert quality_first([fastest, too_slow]) is fastest
    assert quality_first([]) is None
    # the same point with bf16 host moments and with fp32 ones, both fitting: the exact one
    bf16 = _row(1000.0, 0.1, 4, host_state_dtype="bfloat16")
    fp32 = _row(995.0, 0.1, 4, host_state_dtype="float32")
    assert quality_first([bf16, fp32]) is fp32
    assert quality_first([bf16]) is bf16


def test_the_modelled_tuner_ranks_at_the_users_batch(capsys, tmp_path, monkeypatch):
    """At a large batch the tuner models each setting in micro-batches that fit and says
    so; a micro-batch larger than the step is a usage error."""
    from zenflow_triton import profiles as P
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    argv = ["run", "--objective", "modelled", "--quality", "real", "--profile", "a100-pcie4",
            "--model", "opt-350m", "--no-profile"]
    assert cli.main(argv + ["--tokens", "65536"]) == 0
    out = capsys.readouterr().out
    assert "65536 tokens/GPU/step, each setting in its largest micro-batches that fit" in out
    assert cli.main(argv + ["--tokens", "2048", "--micro-batch-tokens", "4096"]) == cli.EXIT_USAGE


def test_the_zero3_offload_runs_are_each_checked_against_the_model():
    from autotune.stepmodel.report import ZERO3_OFFLOAD_RUNS, zero_offload_calibration_table
    table = zero_offload_calibration_table()
    for seqs, published in ZERO3_OFFLOAD_RUNS["runs"]:
        row = next(line for line in table.splitlines() if line.startswith(f"| {seqs} |"))
        assert f"| {published:.2f} |" in row
        model = float(row.split("|")[3])
        err = row.split("|")[4].strip()
        assert err == f"{model / published - 1:+.0%}"


def test_the_zero3_offload_host_memory_is_compared_with_the_published_peak():
    """ZeRO-3 with param offload: DeepSpeed's 16 B per offloaded element (fp32 master, m, v
    and the fp32 gradient partition) and the bf16 params pinned on the host; the table says
    how far that is from the runs' 176.3 GB."""
    from autotune.stepmodel.report import (ZERO3_OFFLOAD_RUNS, zero3_offload_host_gb,
                                           zero_offload_calibration_table)
    wl = S.Workload.from_spec("llama3-8b", tokens=8 * 1024)
    least = S.zenflow_config().min_offload_numel
    offloaded = sum(p.numel for p in wl.params if p.is_matrix(least, ()))
    modelled = zero3_offload_host_gb()
    assert modelled == pytest.approx((offloaded * 16 + wl.numel * 2) / 1e9, rel=1e-3)
    line = next(x for x in zero_offload_calibration_table().splitlines()
                if x.startswith("Host memory"))
    assert f"{modelled:.1f} GB" in line and f"{ZERO3_OFFLOAD_RUNS['host_gb']:.1f} GB" in line
    assert f"{modelled / ZERO3_OFFLOAD_RUNS['host_gb'] - 1:+.0%}" in line


# ---- the loss's memory: the fp32 logits or a chunked cross-entropy ------------------------------
def lm(tokens=1024, dtype="bfloat16", loss="logits") -> S.Workload:
    """A small LM by hand: an 8192 x 64 embedding, one block (q 64 x 64, up 256 x 64), an
    untied 8192 x 64 head."""
    layers = (S.Layer("embed_tokens", (S.ParamSpec("embed_tokens.weight", (8192, 64)),), 0.0),
              S.Layer("layers.0", (S.ParamSpec("layers.0.q.weight", (64, 64)),
                                   S.ParamSpec("layers.0.up.weight", (256, 64))), 6.0 * 20480),
              S.Layer("lm_head", (S.ParamSpec("lm_head.weight", (8192, 64)),), 6.0 * 524288))
    return S.Workload("lm", layers, tokens=tokens, dtype=dtype, mfu=0.5, loss=loss)


def test_the_loss_counts_the_fp32_logits_or_one_chunk_of_them():
    """logits: tokens x vocab x 4. chunked: torch's chunk for bf16 on CUDA, tokens over
    ceil(vocab / hidden), to a power of two, halved (1024 / 128 = 8 -> 4 rows), its logits in
    fp32 and bf16 (6 B), and the head input's gradient (tokens x hidden x 2)."""
    from autotune.stepmodel.activations import loss_chunk_tokens
    assert S.activation_bytes(lm())["logits (fp32)"] == 1024 * 8192 * 4
    assert loss_chunk_tokens(1024, 64, 8192) == 4
    chunked = S.activation_bytes(lm(loss="chunked"))
    assert "logits (fp32)" not in chunked
    assert chunked["logits (chunked cross-entropy)"] == 4 * 8192 * 6 + 1024 * 64 * 2
    fp32 = S.activation_bytes(lm(dtype="float32", loss="chunked"))
    assert fp32["logits (chunked cross-entropy)"] == 4 * 8192 * 4 + 1024 * 64 * 4
    # Llama-3-8B at 4096 tokens: 2.1 GB of fp32 logits; 64-row chunks, 83 MB
    wl = S.Workload.from_preset("llama3-8b", tokens=4096)
    assert S.activation_bytes(wl)["logits (fp32)"] == 4096 * 128256 * 4 == 2_101_346_304
    assert loss_chunk_tokens(4096, 4096, 128256) == 64
    assert S.activation_bytes(wl.replace(loss="chunked"))["logits (chunked cross-entropy)"] \
        == 64 * 128256 * 6 + 4096 * 4096 * 2 == 82_804_736
    # the rest of the activations do not depend on the loss
    assert {k: v for k, v in chunked.items() if not k.startswith("logits")} == \
        {k: v for k, v in S.activation_bytes(lm()).items() if not k.startswith("logits")}
    with pytest.raises(S.StepModelError, match="loss must be one of"):
        lm(loss="fused")


def test_a_chunked_loss_lets_a_larger_micro_batch_fit():
    """Where the fp32 logits of 1024 tokens are what does not fit, the chunked loss fits
    the whole step in one micro-batch; the device memory differs by the loss's bytes alone."""
    h = hw(device_memory_bytes=None)
    whole = {loss: S.predict(h, lm(loss=loss).replace(micro_batch_tokens=1024), "adamw")
             for loss in S.LOSSES}
    gap = 1024 * 8192 * 4 - (4 * 8192 * 6 + 1024 * 64 * 2)
    assert (whole["logits"].device_memory_bytes - whole["chunked"].device_memory_bytes
            == pytest.approx(gap))
    # a card whose usable memory lies halfway between the two
    card = (whole["chunked"].device_memory_bytes + gap / 2) / (1 - S.DEVICE_HEADROOM)
    h = hw(device_memory_bytes=card)
    logits = S.predict_fitting(h, lm(), "adamw")
    chunked = S.predict_fitting(h, lm(loss="chunked"), "adamw")
    assert logits.fits and logits.micro_batch_tokens < 1024
    assert chunked.fits and (chunked.micro_batches, chunked.micro_batch_tokens) == (1, 1024)
    curve = S.batch_curve(h, lm(loss="chunked"), tokens=(1024,), peers=("adamw",))
    assert curve[0].peer_prediction.micro_batch_tokens == 1024   # the curve keeps the loss


def test_predict_says_which_loss_it_counts_and_chunked_fits_more(capsys):
    """Llama-3-8B on a 24 GB card at 4096 tokens (a host large enough for every mode: the
    device is this test's subject): ZeRO-Offload needs two micro-batches of 2048 with the
    fp32 logits, one of 4096 with a chunked loss."""
    argv = ["predict", "--profile", "rtx4090-pcie4", "--model", "llama3-8b", "--tokens",
            "4096", "--host-memory-gb", "512", "--topk-ratio", "0.01", "--update-interval",
            "4", "--no-curve"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "the loss's fp32 logits, --loss logits" in text
    assert "zero-offload 2 x 2048" in text
    assert cli.main(argv + ["--loss", "chunked"]) == 0
    text = capsys.readouterr().out
    assert "chunked cross-entropy" in text and "--loss chunked" in text
    assert "zero-offload 1 x 4096" in text
    assert cli.main(argv + ["--loss", "fused"]) == cli.EXIT_USAGE


def test_the_modelled_tuner_records_the_loss_it_assumed(capsys, tmp_path, monkeypatch):
    from zenflow_triton import profiles as P
    monkeypatch.setenv(P.PROFILE_DIR_ENV, str(tmp_path))
    argv = ["run", "--objective", "modelled", "--quality", "real", "--profile", "a100-pcie4",
            "--model", "opt-350m"]
    assert cli.main(argv + ["--save-as", "chunked-loss", "--loss", "chunked"]) == 0
    assert "the loss's chunked cross-entropy" in capsys.readouterr().out
    assert P.load_profile("chunked-loss").provenance["objective"]["loss"] == "chunked"
    assert cli.main(argv + ["--save-as", "logits-loss"]) == 0
    assert P.load_profile("logits-loss").provenance["objective"]["loss"] == "logits"
    assert cli.main(["run", "--loss", "chunked", "--no-profile"]) == cli.EXIT_USAGE
    assert "--loss: only with --objective modelled" in capsys.readouterr().err
