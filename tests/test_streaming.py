"""Gradient streaming (``stream_grads=True``): the gradient leaves the device in backward
hooks, and training is unchanged by it.

* Bit for bit equal to ``accumulate_on="host"`` (the same computation, moved into the
  hooks): over windows, reselections, warm-up, one-step windows, no overlap, a mid-window
  checkpoint and resume, and ``finish()``, on a tiny Llama and on both backends.
* Micro-batches: each one's gradient streams out and the host worker adds them in the
  grad's dtype, as autograd adds them into ``.grad``: bit for bit equal too (fp32 and bf16).
  A reselection scores the summed gradient (from its host copy), as without streaming.
* Clipping (``max_grad_norm``): one coefficient from the hooks' norms reaches both halves;
  equal to ``torch.nn.utils.clip_grad_norm_`` on ``.grad`` before ``step()``.
* Memory: the live gradient bytes during backward stay near one matrix's gradient plus the
  device columns, where without streaming the whole model's gradient is resident.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.config import ConfigError, ZenFlowConfig
from zenflow_triton.guards.inputs import NonFiniteGradientError
from zenflow_triton.grads.stream import StreamingError, check_streamable

transformers = pytest.importorskip("transformers")

V, SEQ = 64, 12
BASE = dict(topk_ratio=0.25, update_interval=4, select_interval=8, accumulate_on="host",
            min_offload_numel=256)


def tiny_llama(dtype=torch.float32):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48),
                               torch.nn.ReLU(), torch.nn.Linear(48, 8)).to(dtype)


def batches(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, torch.nn.Sequential):
        dtype = next(model.parameters()).dtype
        while True:
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            yield lambda m, x=x.to(dtype), y=y.to(dtype): ((m(x) - y) ** 2).float().mean()
    while True:
        ids = torch.randint(0, V, (4, SEQ), generator=g)
        yield lambda m, ids=ids: m(input_ids=ids, labels=ids).loss


def train(model, steps, *, micro=1, torch_clip=None, resume_at=None, zero_first=False,
          **cfg):
    """``steps`` steps of ``micro`` micro-batches; ``resume_at``: a state_dict and the
    model's weights taken there, loaded into a new optimizer (the first one closed)."""
    kw = dict(BASE, **cfg)
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **kw)
    data = batches(model)
    for t in range(steps):
        if t == resume_at:
            sd, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
            opt.close(finish=False)
            model.load_state_dict(weights)
            opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **kw)
            opt.load_state_dict(sd)
        for _ in range(micro):
            next(data)(model).backward()
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        opt.step()
        opt.zero_grad()
    opt.finish()
    stats = opt.stats()
    opt.close()
    return [p.detach().clone() for p in model.parameters()], stats


def setup(stream, **cfg):
    """An MLP, its optimizer (streaming or not, BASE settings) and its batches."""
    model = mlp()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=stream,
                           **dict(BASE, **cfg))
    return model, opt, batches(model)


def ended(model, opt, finish=True):
    """Finish (or not), close, and the params."""
    if finish:
        opt.finish()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: param {i} differs by {(x - y).abs().max().item()}"


@pytest.mark.parametrize("cfg", [
    dict(), dict(warmup_steps=3), dict(update_interval=1, select_interval=4),
    dict(overlap=False), dict(apply_delay=1), dict(topk_ratio=0.0), dict(topk_ratio=1.0),
    dict(host_betas="window", warmup_steps=2), dict(accumulator_dtype="bfloat16")],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
def test_streaming_equals_host_accumulation_bit_for_bit(cfg):
    want, _ = train(mlp(), 30, **cfg)
    got, stats = train(mlp(), 30, stream_grads=True, **cfg)
    assert_same(want, got, f"stream_grads with {cfg}")
    assert stats["grads_streamed"] == 30 * 3  # every matrix of every step left in its hook


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_llama_streams_bit_for_bit_over_windows_reselections_and_a_resume(backend):
    steps = 18 if backend == "triton" else 26  # the interpreter is slow
    want, _ = train(tiny_llama(), steps, backend=backend)
    got, stats = train(tiny_llama(), steps, stream_grads=True, backend=backend)
    assert_same(want, got, f"stream_grads on the tiny Llama ({backend})")
    # a checkpoint mid-window (step 6 is inside the second window), then a new optimizer
    resumed, _ = train(tiny_llama(), steps, stream_grads=True, backend=backend, resume_at=6)
    assert_same(want, resumed, "stream_grads resumed mid-window")
    assert stats["selection_refreshes"] >= 2 and stats["host_updates"] >= 4, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_micro_batches_stream_out_and_add_up_as_autograd_adds(dtype):
    # Autograd adds micro-batches into .grad in its dtype; the hooks keep the first one's
    # copy and add the next ones into it in the same dtype (the device columns on the
    # device, the host columns on the host): the same additions, so the same bits. The
    # reselection scores the sum (from the host copy), as a resident .grad would be scored.
    want, _ = train(mlp(dtype), 20, micro=3)
    got, _ = train(mlp(dtype), 20, micro=3, stream_grads=True)
    assert_same(want, got, f"3 micro-batches per step, {dtype}")


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_by_the_global_norm_reaches_both_halves(dtype, micro):
    want, _ = train(mlp(dtype), 20, micro=micro, torch_clip=0.05)
    got, stats = train(mlp(dtype), 20, micro=micro, stream_grads=True, max_grad_norm=0.05)
    # The norm is clip_grad_norm_'s (per-tensor norms, then the norm of those, in the grads'
    # dtype and its order), and the coefficient scales each gradient in its dtype as
    # clip_grad_norm_ does: one micro-batch gives its bits. With several, a summed
    # gradient's norm adds its device and host columns' squares in fp32, then rounds once:
    # a few fp32 ulps of the coefficient, which a bf16 product may round one ulp the other
    # way. The trajectory then moves by a few of lr-sized Adam steps' roundings at most:
    # bound it by 4 steps of lr 1e-2 in bf16 and by fp32 rounding of the params (|p| < 1)
    # over 20 steps in fp32.
    if micro == 1:
        assert_same(want, got, f"max_grad_norm, one micro-batch, {dtype}")
    tol = 4e-2 if dtype == torch.bfloat16 else 20 * 2 * 2.0 ** -23
    for i, (a, b) in enumerate(zip(want, got)):
        assert (a - b).abs().max().item() <= tol, f"param {i}: {(a - b).abs().max().item()}"
    # and the clipping was real: without it the trajectory is another one
    free, _ = train(mlp(dtype), 20, micro=micro, stream_grads=True)
    assert any((a - b).abs().max().item() > 1e-3 for a, b in zip(free, got))


def test_clipping_without_streaming_equals_clip_grad_norm():
    want, _ = train(tiny_llama(), 12, torch_clip=0.3)
    got, _ = train(tiny_llama(), 12, max_grad_norm=0.3)
    assert_same(want, got, "max_grad_norm without streaming")  # clip_grad_norm_'s bits


def test_live_gradient_bytes_stay_near_one_matrix():
    # 8 equal matrices: without streaming the whole model's gradient is resident at step();
    # with it, a hook holds at most one matrix's gradient and its host columns' gather, plus
    # every matrix's device columns (k of cols) and, on a selecting step, its column scores.
    torch.manual_seed(0)
    n, width = 8, 128
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n)])
    one = width * width * 4
    total = n * one

    def peak(**cfg):
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, topk_ratio=0.1,
                               update_interval=2, accumulate_on="host", **cfg)
        for _ in range(6):
            model(torch.randn(4, width)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out = opt.stats()["grad_bytes_peak"]
        opt.close()
        return out

    assert peak() == total
    k = round(0.1 * width)
    bound = 2 * one + n * width * k * 4 + n * width * 4
    streamed = peak(stream_grads=True)
    assert streamed <= bound, (streamed, bound)
    assert streamed < total / 2, (streamed, total)


def test_the_first_backward_streams_and_small_params_keep_their_grad():
    model = tiny_llama()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **{
        k: v for k, v in BASE.items() if k != "accumulate_on"})
    assert opt.config.accumulate_on == "host"  # implied
    next(batches(model))(model).backward()
    split = [n for n, p in model.named_parameters() if p.grad is None]
    kept = [n for n, p in model.named_parameters() if p.grad is not None]
    assert split and all("proj" in n for n in split), split
    assert all("norm" in n or "embed" in n or "lm_head" in n for n in kept), kept
    opt.close()
    # closed: the hooks are gone, gradients stay in .grad
    model.zero_grad()
    next(batches(model))(model).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_nonfinite_micro_batch_skips_the_step_and_drops_its_gradients():
    def run(stream):
        model, opt, data = setup(stream)
        for t in range(12):
            for j in range(2):
                loss = next(data)(model)
                if t == 5 and j == 1:
                    loss = loss * float("inf")
                loss.backward()
            if t == 5:
                steps = opt.stats()["steps"]
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
                assert opt.stats()["steps"] == steps
            else:
                opt.step()
            opt.zero_grad()
        return ended(model, opt)

    assert_same(run(False), run(True), "a skipped step")


def test_zero_grad_drops_streamed_gradients():
    def run(stream):
        model, opt, data = setup(stream)
        for t in range(10):
            next(data)(model).backward()
            if t == 3:  # a batch thrown away
                opt.zero_grad()
                next(data)(model).backward()
            opt.step()
            opt.zero_grad()
        return ended(model, opt, finish=False)

    assert_same(run(False), run(True), "zero_grad between backward and step")


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="stream_grads"):
        ZenFlowConfig(stream_grads="yes")
    with pytest.raises(ConfigError, match="max_grad_norm"):
        ZenFlowConfig(max_grad_norm=0.0)
    with pytest.raises(ConfigError, match="max_grad_norm"):
        ZenFlowConfig(max_grad_norm=float("nan"))

    class Shard:  # what the optimizer's RowShard says under DDP
        world, collective, split_rows = 2, True, True
    with pytest.raises(StreamingError, match="DDP"):
        check_streamable(ZenFlowConfig(stream_grads=True), Shard())
    check_streamable(ZenFlowConfig(), Shard())  # no streaming: nothing to refuse


def test_hf_trainer_moves_clipping_into_the_optimizer(tmp_path):
    from zenflow_triton.hf import trainer_kwargs

    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, report_to=[],
        use_cpu=True, save_strategy="no", max_grad_norm=0.5, disable_tqdm=True, seed=0,
        learning_rate=1e-2, dataloader_num_workers=0)
    with pytest.warns(UserWarning, match="max_grad_norm"):
        kw = trainer_kwargs(model, args, stream_grads=True, **{
            k: v for k, v in BASE.items() if k != "accumulate_on"})
    opt = kw["optimizers"][0]
    assert opt.config.max_grad_norm == 0.5 and args.max_grad_norm == 0.0

    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = (torch.arange(SEQ) + i) % V
            return {"input_ids": ids, "labels": ids}

    trainer = transformers.Trainer(model=model, args=args, train_dataset=Ids(), **kw)
    try:
        trainer.train()
        stats = opt.stats()
        assert stats["steps"] == 8 and stats["grads_streamed"] >= 8 * 14, stats
        assert all(math.isfinite(float(p.detach().float().abs().max()))
                   for p in model.parameters())
    finally:
        opt.close()


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, V, (n, 1), generator=g) + torch.arange(SEQ)) % V


def test_accelerate_accumulation_streams_like_host_accumulation():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    def run(stream):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        model = tiny_llama()
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=stream,
                               max_grad_norm=1.0, **BASE)
        loader = torch.utils.data.DataLoader(_ids(48), batch_size=4)
        acc = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        try:
            p_model, p_opt, p_loader = acc.prepare(model, opt, loader)
            for ids in p_loader:
                with acc.accumulate(p_model):
                    acc.backward(p_model(input_ids=ids, labels=ids).loss)
                    p_opt.step()
                    p_opt.zero_grad()
            assert opt.stats()["steps"] == 6  # 12 micro-batches, 2 per step
            opt.finish()
            return [p.detach().clone() for p in model.parameters()]
        finally:
            opt.close()
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()

    assert_same(run(False), run(True), "Accelerate, 2 micro-batches per step")


def test_lightning_closure_streams_like_host_accumulation(tmp_path):
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self, stream):
            super().__init__()
            self.net, self.stream = tiny_llama(), stream

        def training_step(self, ids, i):
            return self.net(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            self.opt = ZenFlowOptimizer(self.net.named_parameters(), lr=1e-2,
                                        stream_grads=self.stream, **BASE)
            return self.opt

    def run(stream):
        m = Module(stream)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            default_root_dir=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(m, torch.utils.data.DataLoader(_ids(40), batch_size=4))
        m.opt.finish()
        m.opt.close()
        return [p.detach().clone() for p in m.net.parameters()]

    assert_same(run(False), run(True), "Lightning, step(closure)")


def test_grad_scaler_is_refused_with_the_reason_and_works_without_streaming():
    def attempt(stream):
        model = mlp()
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=stream, **BASE)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(next(batches(model))(model)).backward()
        try:
            scaler.step(opt)
            scaler.update()
            return opt.stats()["steps"]
        finally:
            opt.close()

    assert attempt(False) == 1
    with pytest.raises(StreamingError, match=r"stream_grads .*GradScaler \(fp16 loss scaling"):
        attempt(True)



def test_a_load_between_backward_and_step_cuts_the_gradient_by_the_loaded_selection():
    # Without streaming, .grad waits for the step whatever state is loaded meanwhile; with
    # it, the hooks cut the gradient by the selection of their time, so a load makes it
    # whole again and the step cuts it by the loaded one (also where the loaded step
    # reselects, which scores that gradient).
    def run(stream, save_at, load_at):
        model, opt, data = setup(stream)
        saved = None
        for t in range(1, 15):
            next(data)(model).backward()
            if t == load_at:
                opt.load_state_dict(saved)
            opt.step()
            opt.zero_grad()
            if t == save_at:
                saved = opt.state_dict()
        return ended(model, opt)

    for save_at, load_at in ((5, 11), (8, 11)):  # (8: the loaded step 9 reselects)
        assert_same(run(False, save_at, load_at), run(True, save_at, load_at),
                    f"state of step {save_at} loaded before step {load_at}")


def test_an_overflowing_sum_of_finite_micro_batches_is_caught():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    try:
        for _ in range(2):  # each finite, their sum inf (fp32 max 3.4e38)
            model(torch.ones(1, 32)).sum().mul(2e38).backward()
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.close()


def test_clipping_summed_micro_batches_of_device_only_matrices():
    got, _ = train(mlp(), 6, micro=2, stream_grads=True, max_grad_norm=0.05, topk_ratio=1.0)
    want, _ = train(mlp(), 6, micro=2, torch_clip=0.05, topk_ratio=1.0)
    for a, b in zip(want, got):
        assert (a - b).abs().max().item() <= 6 * 2 * 2.0 ** -23


def test_a_newer_optimizer_takes_the_params_over():
    model = mlp()
    old = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    with pytest.warns(UserWarning, match="takes them over"):
        new = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    try:
        next(batches(model))(model).backward()
        assert new._stream.pending and not old._stream.pending
        before = [p.detach().clone() for p in model.parameters()]
        new.step()
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    finally:
        old.close()
        new.close()


def _steps(model, opt, n):
    data = batches(model)
    for _ in range(n):
        opt.zero_grad()
        next(data)(model).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_second_optimizer_that_does_not_stream_trains_the_matrices():
    """The first, streaming one still open: the second (not streaming) takes its params over,
    with a warning naming both, and trains exactly as if it were alone."""
    lone = mlp()
    alone = ZenFlowOptimizer(lone.named_parameters(), lr=1e-2, **BASE)
    want = _steps(lone, alone, 3)
    alone.close()
    model = mlp()
    old = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **BASE)
    try:
        text = " ".join(str(w.message) for w in caught)
        assert f"{id(new):#x} (not streaming)" in text and f"{id(old):#x}" in text, text
        assert "takes them over" in text
        got = _steps(model, new, 3)
        assert not old._stream.pending
        assert_same(want, got, "the second optimizer beside an open streaming one")
    finally:
        old.close()
        new.close()


def test_a_plain_optimizer_built_beside_an_open_streaming_one_is_warned_about():
    """torch's AdamW cannot be told apart at construction: its first step over params whose
    gradients an open streaming optimizer takes is warned about (once), naming it; with
    that one closed it trains them."""
    model = mlp()
    old = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(model)
    try:
        next(data)(model).backward()
        assert model[0].weight.grad is None  # the streaming one took it
        with pytest.warns(UserWarning, match=f"AdamW steps params .* {id(old):#x}.* None"):
            adamw.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            adamw.step()  # once
    finally:
        old.zero_grad()
        old.close()
    before = model[0].weight.detach().clone()
    adamw.zero_grad()
    next(data)(model).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adamw.step()
    assert not torch.equal(before, model[0].weight)


def test_closing_with_streamed_gradients_pending_drops_them_and_says_so():
    model = mlp()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, stream_grads=True, **BASE)
    next(batches(model))(model).backward()
    with pytest.warns(UserWarning, match="dropped"):
        opt.close()
    assert not opt._stream.pending


def test_the_trainer_moves_clipping_for_a_profile_that_streams(tmp_path):
    from zenflow_triton.hf import trainer_kwargs

    model = tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          max_grad_norm=1.0)
    with pytest.warns(UserWarning):
        kw = trainer_kwargs(model, args, profile="rtx4090-pcie4", fit="skip")
    opt = kw["optimizers"][0]
    try:
        assert opt.config.stream_grads and opt.config.max_grad_norm == 1.0
        assert args.max_grad_norm == 0.0
    finally:
        opt.close()


@pytest.mark.parametrize("how", ["asked", "profile"])
def test_the_trainer_builds_the_optimizer_once_when_it_moves_clipping(tmp_path, monkeypatch,
                                                                      how):
    import zenflow_triton.hf as hf

    built = []

    class Counted(ZenFlowOptimizer):
        def __init__(self, *a, **kw):
            built.append(kw.get("max_grad_norm"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(hf, "ZenFlowOptimizer", Counted)
    model = tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          max_grad_norm=0.5)
    kw = (dict(profile="rtx4090-pcie4", fit="skip") if how == "profile" else
          dict(stream_grads=True, **{k: v for k, v in BASE.items() if k != "accumulate_on"}))
    with pytest.warns(UserWarning, match="moves max_grad_norm"):
        opt = hf.trainer_kwargs(model, args, **kw)["optimizers"][0]
    try:
        assert built == [0.5] and opt.config.max_grad_norm == 0.5 and opt.config.stream_grads
        assert args.max_grad_norm == 0.0
    finally:
        opt.close()


@pytest.mark.parametrize("bad", ["loss", "one matrix"])
def test_a_skipped_step_drops_its_whole_gradient_without_zero_grad(bad):
    # A step that raises NonFiniteGradientError is skipped with its gradients: the next
    # backward and step see only their own, whether zero_grad() comes between or not, as a
    # run without streaming does with zero_grad(); the optimizer's state is untouched.
    # "one matrix": only a matrix's gradient is bad, the small params' stay finite (and
    # would be added into the next step's if the skipped step kept them).
    def run(stream, zero_after_skip):
        model, opt, data = setup(stream)
        for t in range(12):
            for j in range(2):
                loss = next(data)(model)
                hook = None
                if t == 5 and j == 1 and bad == "loss":
                    loss = loss * float("inf")
                elif t == 5 and j == 1:
                    hook = model[2].weight.register_hook(lambda g: g * float("inf"))
                loss.backward()
                if hook is not None:
                    hook.remove()
            if t == 5:
                before = opt.state_dict()
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
                after = opt.state_dict()
                assert after["param_groups"] == before["param_groups"]
                for i, st in before["state"].items():
                    for k, v in st.items():
                        w = after["state"][i][k]
                        assert (torch.equal(v, w) if isinstance(v, torch.Tensor)
                                else v == w), f"param {i} {k} changed by a skipped step"
                if zero_after_skip:
                    opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        return ended(model, opt)

    want = run(False, True)
    assert_same(want, run(True, True), "a skipped step, zero_grad after it")
    assert_same(want, run(True, False), "a skipped step, no zero_grad after it")
