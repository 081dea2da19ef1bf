"""ZenFlowOptimizer driven by the real training frameworks: Lightning, the HF Trainer, Accelerate.

Each test trains a tiny model (built in code, nothing downloaded) on a learnable synthetic task
with settings that give every matrix both device- and host-owned columns and overlapped host
jobs, and checks that the framework's loop really stepped this optimizer (every step, with the
closure where the framework passes one), that host updates happened and that the loss fell.

Also here: a wrapper object sharing the optimizer's threads (as Lightning's LightningOptimizer
does) may be garbage-collected without stopping them. (copy.copy is the weakest of the three
wrappers: torch's Optimizer.__getstate__ copies only defaults, state and param_groups, so the
copy holds no threads at all; the other two share them, as Lightning's wrapper does.)
"""

from __future__ import annotations

import copy
import gc
import math

import accelerate
import lightning as L
import pytest
import torch
import transformers
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from zenflow_triton import ZenFlowOptimizer

# Both column owners in every matrix (16 and 32 input columns: 4 and 8 on the device), one
# host window every 2 steps, the result applied one window later (overlap, the default).
ZF = dict(topk_ratio=0.25, update_interval=2, min_offload_numel=64)
D_IN, D_HID, D_OUT = 16, 32, 4


def regression_data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: y is a fixed smooth function of x (a random tanh layer, scaled so
    the first gradients are large enough for clipping at 1.0 to act)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    w = torch.randn(D_IN, D_OUT, generator=g) / math.sqrt(D_IN)
    return x, 3.0 * torch.tanh(2.0 * x @ w)


def tiny_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT))


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def assert_loss_fell(losses: list[float], k: int, what: str) -> None:
    assert len(losses) >= 2 * k, f"{what}: only {len(losses)} losses recorded"
    assert all(math.isfinite(v) for v in losses), f"{what}: non-finite loss in {losses}"
    first, last = mean(losses[:k]), mean(losses[-k:])
    assert last < 0.8 * first, (f"{what}: loss did not fall: mean of the first {k} steps "
                                f"{first:.4f}, of the last {k} {last:.4f}; all: "
                                f"{[round(v, 4) for v in losses]}")


def assert_split_and_host_work(opt: ZenFlowOptimizer, steps: int, what: str) -> None:
    st = opt.stats()
    assert st["steps"] == steps, f"{what}: the optimizer stepped {st['steps']} times, not {steps}"
    assert 0.0 < st["device_owned_fraction"] < 1.0, (
        f"{what}: expected both device- and host-owned columns, device-owned fraction is "
        f"{st['device_owned_fraction']}")
    windows = steps // ZF["update_interval"]
    assert st["host_updates"] == windows, (
        f"{what}: {st['host_updates']} host updates in {steps} steps, expected one per "
        f"window of {ZF['update_interval']} steps ({windows})")


def count_steps(opt: ZenFlowOptimizer) -> dict:
    """Record every call of opt.step (through torch's step hooks): whether it got a closure,
    and whether a step is running now (so the closure can tell it runs inside one)."""
    rec = dict(calls=0, with_closure=0, inside=False)

    def pre(_opt, args, kwargs):
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        rec["calls"] += 1
        rec["with_closure"] += callable(closure)
        rec["inside"] = True

    def post(_opt, args, kwargs):
        rec["inside"] = False

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    return rec


# ---------------------------------------------------------------- wrappers of the optimizer
class ForwardingWrapper(ZenFlowOptimizer):
    """What Lightning's LightningOptimizer is: an instance of a subclass of the optimizer's
    class that never ran its __init__ and forwards every missing attribute to the optimizer."""

    def __init__(self, inner: ZenFlowOptimizer) -> None:  # no super().__init__, on purpose
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self.__dict__["_inner"], name)


def dict_copy(opt: ZenFlowOptimizer) -> ZenFlowOptimizer:
    """An instance of the optimizer's class holding a copy of its __dict__ (threads shared)."""
    w = object.__new__(type(opt))
    w.__dict__.update(opt.__dict__)
    return w


@pytest.mark.parametrize("make_wrapper", [copy.copy, dict_copy, ForwardingWrapper],
                         ids=["copy.copy", "dict-copy", "forwarding-wrapper"])
def test_collecting_a_wrapper_leaves_the_optimizer_working(make_wrapper):
    model = tiny_mlp()
    x, y = regression_data()
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **ZF)
    losses = []

    def train(steps):
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            losses.append(loss.item())
            loss.backward()
            opt.step()
            opt.zero_grad()

    try:
        train(3)  # a host job is in flight from step 2 on
        w = make_wrapper(opt)
        del w
        gc.collect()
        train(9)  # the worker must still run (and apply) the host windows
        assert_split_and_host_work(opt, 12, "after collecting a wrapper")
        opt.synchronize()
        assert not opt.stats()["host_inflight"]
        assert_loss_fell(losses, 3, "after collecting a wrapper")
    finally:
        opt.close()


# ---------------------------------------------------------------- Lightning
# Lightning's own pytree helper on this torch: harmless, not ours.
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)`:FutureWarning")
def test_lightning_trainer_fit_steps_with_closure_and_clipping(tmp_path):
    x, y = regression_data()
    steps, batch = 24, 8  # 8 batches an epoch, 3 epochs
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch,
                                         shuffle=False)

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tiny_mlp()
            self.losses: list[float] = []
            self.inside_step: list[bool] = []
            self.clipped_norms: list[float] = []
            self.raw_norms: list[float] = []
            self.zf: ZenFlowOptimizer | None = None
            self.rec: dict | None = None

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.mse_loss(self.net(xb), yb)
            self.losses.append(loss.item())
            self.inside_step.append(self.rec["inside"])
            return loss

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                        gradient_clip_algorithm=None):
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.raw_norms.append(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
            super().configure_gradient_clipping(optimizer, gradient_clip_val,
                                                gradient_clip_algorithm)
            self.clipped_norms.append(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

        def configure_optimizers(self):
            self.zf = ZenFlowOptimizer(self.parameters(), lr=1e-2, **ZF)
            self.rec = count_steps(self.zf)
            return self.zf

    module = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path)
    try:
        trainer.fit(module, loader)
        opt = module.zf
        assert trainer.global_step == steps, f"Lightning ran {trainer.global_step} steps"
        assert module.rec["calls"] == steps and module.rec["with_closure"] == steps, (
            f"Lightning should call step(closure) on each of the {steps} steps: "
            f"{module.rec['calls']} calls, {module.rec['with_closure']} with a closure")
        assert len(module.losses) == steps and all(module.inside_step), (
            "every training_step must run inside optimizer.step (as its closure): "
            f"{module.inside_step}")
        assert len(module.clipped_norms) == steps, "gradient clipping did not run every step"
        assert max(module.clipped_norms) <= 1.0 + 1e-4, (
            f"clipped gradient norms above 1.0: {module.clipped_norms}")
        assert max(module.raw_norms) > 1.0, (
            f"no gradient norm exceeded the clip value, clipping was not exercised: "
            f"{module.raw_norms}")
        assert_split_and_host_work(opt, steps, "Lightning")
        assert_loss_fell(module.losses, 4, "Lightning")

        # The LightningOptimizer wrappers of the fit are gone now: the optimizer still works.
        gc.collect()
        module.net.zero_grad()
        nn.functional.mse_loss(module.net(x), y).backward()
        opt.step()
        assert opt.stats()["steps"] == steps + 1
        opt.eval()
        assert not opt.stats()["host_inflight"]
    finally:
        if module.zf is not None:
            module.zf.close()


# ---------------------------------------------------------------- HF Trainer
V, SEQ = 64, 12


class CountingDataset(torch.utils.data.Dataset):
    """Sequences that count up mod V from a random start: the next token is learnable."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, V, (n, 1), generator=g)
        self.ids = (starts + torch.arange(SEQ)) % V

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def hf_args(tmp_path, steps: int, **kw):
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, max_grad_norm=1.0,
        disable_tqdm=True, seed=0, dataloader_num_workers=0, **kw)


def hf_losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_hf_trainer_with_given_optimizer_and_warmup_schedule(tmp_path):
    steps = 20
    model = tiny_llama()
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **ZF)
    rec = count_steps(opt)
    sched = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2,
                                                         num_training_steps=steps)
    assert opt.param_groups[0]["lr"] == 0.0  # the warm-up starts at lr 0
    trainer = transformers.Trainer(model=model, args=hf_args(tmp_path, steps),
                                   train_dataset=CountingDataset(64), optimizers=(opt, sched))
    try:
        trainer.train()
        assert trainer.state.global_step == steps
        assert rec["calls"] == steps, f"the Trainer called step {rec['calls']} times"
        assert_split_and_host_work(opt, steps, "HF Trainer")
        losses = hf_losses(trainer)
        assert len(losses) == steps, f"expected one logged loss per step: {losses}"
        assert_loss_fell(losses, 3, "HF Trainer")

        # The last window's host result is still deferred; Trainer.evaluate() calls
        # optimizer.eval() (through Accelerate's wrapper), which must apply it first.
        assert opt.stats()["host_inflight"], "expected the last window's host job in flight"
        before = [p.detach().clone() for p in model.parameters()]
        metrics = trainer.evaluate(CountingDataset(16, seed=1))
        assert not opt.stats()["host_inflight"] and not opt.training
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), (
            "evaluate() did not apply the pending host result to the params")
        assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] < losses[0], metrics
    finally:
        opt.close()


def test_trainer_kwargs_without_args_or_lr_says_which_lr_it_trains_at():
    from zenflow_triton.hf import trainer_kwargs

    model = tiny_llama()
    with pytest.warns(UserWarning, match=r"neither TrainingArguments \(args\) nor lr=.*lr=1e-3"):
        kw = trainer_kwargs(model, **ZF)
    opt = kw["optimizers"][0]
    assert opt.param_groups[0]["lr"] == 1e-3
    opt.close()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an lr given: nothing to say
        kw = trainer_kwargs(model, lr=2e-5, **ZF)
    assert kw["optimizers"][0].param_groups[0]["lr"] == 2e-5
    kw["optimizers"][0].close()


def test_hf_trainer_builds_the_optimizer_from_cls_and_kwargs(tmp_path):
    # Trainer(optimizer_cls_and_kwargs=...) exists from transformers 4.47 (the [test] bound)
    steps = 20
    model = tiny_llama()
    args = hf_args(tmp_path, steps, learning_rate=1e-2, warmup_steps=2, weight_decay=0.01)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CountingDataset(64),
                                   optimizer_cls_and_kwargs=(ZenFlowOptimizer,
                                                             dict(lr=1e-2, **ZF)))
    opt = None
    try:
        with pytest.warns(UserWarning, match=r"save_model\(\) after train\(\) would miss the "
                                             r"last window.*trainer_kwargs"):
            trainer.train()
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        assert isinstance(opt, ZenFlowOptimizer), f"the Trainer built {type(opt)}"
        # The Trainer's two groups: weight decay on the matrices, none on norms and biases.
        assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.01]
        assert trainer.state.global_step == steps
        assert_split_and_host_work(opt, steps, "HF Trainer (optimizer_cls_and_kwargs)")
        assert_loss_fell(hf_losses(trainer), 3, "HF Trainer (optimizer_cls_and_kwargs)")
    finally:
        if opt is None and trainer.optimizer is not None:
            opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if isinstance(opt, ZenFlowOptimizer):
            opt.close()


# ---------------------------------------------------------------- Accelerate
def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState) that an
    earlier Accelerator (e.g. the HF Trainer's) configured."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate_state():
    """Start and leave Accelerate's singletons clean."""
    reset_accelerate()
    yield
    reset_accelerate()


def test_accelerate_gradient_accumulation_loop(fresh_accelerate_state):
    accum, epochs, batch = 2, 3, 4
    x, y = regression_data()
    batches = epochs * (len(x) // batch)
    model = tiny_mlp()
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **ZF)
    rec = count_steps(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))  # from lr 0
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    accelerator = accelerate.Accelerator(gradient_accumulation_steps=accum, cpu=True)
    try:
        # prepare() round-trips the (still empty) optimizer state_dict before the first step
        p_model, p_opt, p_loader, p_sched = accelerator.prepare(model, opt, loader, sched)
        assert p_opt.optimizer is opt
        losses, syncs = [], 0
        for _ in range(epochs):
            for xb, yb in p_loader:
                with accelerator.accumulate(p_model):
                    loss = nn.functional.mse_loss(p_model(xb), yb)
                    losses.append(loss.item())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        syncs += 1
                        norm = accelerator.clip_grad_norm_(p_model.parameters(), 1.0)
                        assert math.isfinite(float(norm))
                    p_opt.step()
                    p_sched.step()
                    p_opt.zero_grad()
        assert len(losses) == batches
        assert syncs == batches // accum, f"{syncs} sync steps in {batches} batches"
        assert rec["calls"] == batches // accum, (
            f"the optimizer should step on sync steps only: {rec['calls']} steps in "
            f"{batches} batches with gradient_accumulation_steps={accum}")
        assert sched.last_epoch == batches // accum, (
            f"the scheduler stepped {sched.last_epoch} times, not once per optimizer step")
        assert_split_and_host_work(opt, batches // accum, "Accelerate")
        # one epoch of micro-batches at the start against the last one
        assert_loss_fell(losses, len(x) // batch, "Accelerate")
    finally:
        opt.close()


def run_accelerate(steps: int, checkpoint_dir=None, save_after: int = 0):
    """A plain Accelerate loop (no accumulation); with ``checkpoint_dir``, save_state() after
    ``save_after`` steps (mid-window: a host job in flight) and load_state() it back at once.
    Returns the losses and the final params."""
    reset_accelerate()
    x, y = regression_data()
    model = tiny_mlp()
    # the schedule as given (a job in flight at the save): not switched by fresh_if_spread
    opt = ZenFlowOptimizer(model.parameters(), lr=1e-2, **ZF, fresh_if_spread=False)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    accelerator = accelerate.Accelerator(cpu=True)
    losses = []
    try:
        p_model, p_opt, p_loader = accelerator.prepare(model, opt, loader)
        while len(losses) < steps:
            for xb, yb in p_loader:
                if checkpoint_dir is not None and len(losses) == save_after:
                    assert opt.stats()["host_inflight"], "save point is not mid-window"
                    accelerator.save_state(str(checkpoint_dir))
                    accelerator.load_state(str(checkpoint_dir))
                    assert opt.stats()["steps"] == save_after
                loss = nn.functional.mse_loss(p_model(xb), yb)
                losses.append(loss.item())
                accelerator.backward(loss)
                p_opt.step()
                p_opt.zero_grad()
                if len(losses) == steps:
                    break
        assert_split_and_host_work(opt, steps, "Accelerate save/load")
        return losses, [p.detach().clone() for p in model.parameters()]
    finally:
        opt.close()
        reset_accelerate()


def test_accelerate_save_and_load_state_mid_window_keeps_the_trajectory(tmp_path):
    steps = 12
    ref_losses, ref_params = run_accelerate(steps)
    losses, params = run_accelerate(steps, tmp_path / "ckpt", save_after=5)
    assert_loss_fell(ref_losses, 3, "Accelerate save/load")
    assert losses == ref_losses, f"losses differ after save/load: {losses} vs {ref_losses}"
    for i, (a, b) in enumerate(zip(params, ref_params)):
        assert torch.equal(a, b), (f"param {i} differs after save_state/load_state: max abs "
                                   f"diff {(a - b).abs().max().item():.3g}")


def test_hf_trainer_saves_under_ddp_on_rank_0(tmp_path):
    """The HF Trainer under DDP (2 gloo ranks, torchrun) saves the optimizer on rank 0 only;
    with ``zenflow_triton.hf.ZenFlowCallback`` every rank gathers the host halves first, so
    the checkpoints at steps 4 and 8 hold every row (the full form) and the ranks go on
    with the same params."""
    from .test_distributed import torchrun

    torchrun(["tests/support/hf_ddp_save.py", str(tmp_path)], timeout=300)
    res = torch.load(tmp_path / "result.pt", weights_only=False)
    assert res["world"] == 2 and res["steps"] == 8 and res["saved_step"] == 8
    # Every split matrix of the tiny Llama (32 or 64 rows, and the 64-row head) saved whole.
    model = tiny_llama()
    want = sorted(p.shape[0] for n, p in model.named_parameters()
                  if p.dim() == 2 and p.numel() >= 64 and "embed" not in n
                  and "lm_head" not in n)
    assert res["rows"] == want
    a, b = res["params"]
    assert torch.equal(a, b)
