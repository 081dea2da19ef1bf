"""The end of training and the switches users make (issue "Finish what you train"): finish()
and close() leave every gradient applied, the HF Trainer saves a complete model, AdamW
checkpoints load as frameworks save them, params without names are named in a warning,
Ctrl-C under any handler never kills an optimizer, a frozen layer stops where AdamW would
have it, and bad settings fail early."""

from __future__ import annotations

import signal
import threading
import time
import warnings

import pytest
import torch
import transformers

from zenflow_triton import ZenFlowOptimizer
from zenflow_triton.hf import ZenFlowCallback, trainer_kwargs

from .support.helpers import batches, loss_fn, make_model, params_of
from .test_frameworks import CountingDataset, hf_args, tiny_llama

# the schedule as given: the random data's spread gradient would otherwise switch it to
# apply_delay=1 (fresh_if_spread; its own tests in test_spread.py)
SPLIT = dict(topk_ratio=0.25, update_interval=4, min_offload_numel=64, fresh_if_spread=False)


def run(model, opt, data):
    for x in data:
        opt.zero_grad()
        loss_fn(model, x).backward()
        opt.step()


def same_tensors(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- 2: an end of training
def test_finish_applies_the_open_window_and_every_pending_result():
    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
    run(model, opt, batches(10))  # stops mid-window: 2 gradients accumulated, one job pending
    with pytest.raises(ValueError, match="window is open"):
        opt.to_adamw_state_dict()
    before = params_of(model)
    opt.finish()
    assert not same_tensors(before, params_of(model)), "finish() applied nothing"
    states = [s for s in opt.state.values() if s.get("kind") == "matrix"]
    assert states and all(s["acc_count"] == 0 and not s["host_pending"] for s in states)
    opt.to_adamw_state_dict()  # no window open any more
    after = params_of(model)
    opt.finish()  # nothing left: a second call changes nothing
    assert same_tensors(after, params_of(model))
    run(model, opt, batches(3, seed=7))  # training may go on after it
    opt.close()


def test_close_finishes_and_only_an_exception_or_a_hand_over_does_not():
    """close() is finish() then stop (nothing given to step() is lost); leaving a ``with``
    block by an exception, or close(finish=False) (the state handed to a new optimizer of the
    same model), stops without touching the params."""
    data = batches(10)
    model_a = make_model()
    opt_a = ZenFlowOptimizer(model_a.named_parameters(), lr=1e-2, **SPLIT)
    run(model_a, opt_a, data)
    stopped = params_of(model_a)
    opt_a.close(finish=False)
    assert same_tensors(stopped, params_of(model_a))

    model_b = make_model()
    opt_b = ZenFlowOptimizer(model_b.named_parameters(), lr=1e-2, **SPLIT)
    run(model_b, opt_b, data)
    opt_b.finish()
    finished = params_of(model_b)
    opt_b.close()
    assert not same_tensors(finished, stopped)

    model_c = make_model()
    with ZenFlowOptimizer(model_c.named_parameters(), lr=1e-2, **SPLIT) as opt_c:
        run(model_c, opt_c, data)
    assert same_tensors(finished, params_of(model_c)), "close() lost the open window"

    model_d = make_model()
    with pytest.raises(RuntimeError, match="boom"):
        with ZenFlowOptimizer(model_d.named_parameters(), lr=1e-2, **SPLIT) as opt_d:
            run(model_d, opt_d, data)
            raise RuntimeError("boom")
    assert same_tensors(stopped, params_of(model_d)), "an exception's exit applied work"


# ---------------------------------------------------------------- 1: the HF Trainer's model
def hf_train(tmp_path, steps, save_steps=None):
    model = tiny_llama()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, logging_steps=1, max_grad_norm=1.0, disable_tqdm=True,
        seed=0, dataloader_num_workers=0, learning_rate=1e-2, weight_decay=0.01,
        **(dict(save_strategy="steps", save_steps=save_steps) if save_steps
           else dict(save_strategy="no")))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CountingDataset(64),
                                   **trainer_kwargs(model, args, **SPLIT))
    return model, trainer


def zenflow_of(trainer) -> ZenFlowOptimizer:
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)


def test_hf_trainer_save_model_holds_every_gradient(tmp_path):
    model, trainer = hf_train(tmp_path / "run", 10)
    opt = zenflow_of(trainer)
    try:
        trainer.train()
        trainer.save_model(str(tmp_path / "final"))
        saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
        opt.finish()  # nothing may be left to apply: the callback finished at train end
        for name, p in model.named_parameters():
            assert torch.equal(saved.state_dict()[name], p.detach()), name
        assert all(s["acc_count"] == 0 and not s["host_pending"]
                   for s in opt.state.values() if s.get("kind") == "matrix")
    finally:
        opt.close()


def test_hf_trainer_resume_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(tmp_path):
    plain, trainer = hf_train(tmp_path / "plain", 10)
    trainer.train()
    zenflow_of(trainer).close()
    saving, trainer = hf_train(tmp_path / "saving", 10, save_steps=6)
    trainer.train()  # writes checkpoint-6 mid-window, finishes at the end
    zenflow_of(trainer).close()
    resumed, trainer = hf_train(tmp_path / "resumed", 10)
    trainer.train(resume_from_checkpoint=str(tmp_path / "saving" / "checkpoint-6"))
    zenflow_of(trainer).close()
    for (name, a), b, c in zip(plain.named_parameters(), saving.parameters(),
                               resumed.parameters()):
        assert torch.equal(a, b), f"saving a checkpoint changed the trajectory: {name}"
        assert torch.equal(a, c), f"the resumed run differs: {name}"


def test_trainer_kwargs_keep_the_dense_set_and_the_trainers_two_groups(tmp_path):
    model = tiny_llama()
    args = hf_args(tmp_path, 1, learning_rate=1e-3, weight_decay=0.01)
    kw = trainer_kwargs(model, args, **SPLIT)
    opt, sched = kw["optimizers"]
    assert sched is None and isinstance(kw["callbacks"][0], ZenFlowCallback)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.01]
    named = ZenFlowOptimizer(model.named_parameters(), lr=1e-3, **SPLIT)
    assert opt.stats()["device_owned_fraction"] == named.stats()["device_owned_fraction"]
    unnamed = [p for p in model.parameters()]
    with pytest.warns(UserWarning, match="without names"):
        plain = ZenFlowOptimizer(unnamed, lr=1e-3, **SPLIT)
    assert plain.stats()["device_owned_fraction"] < opt.stats()["device_owned_fraction"]
    for o in (opt, named, plain):
        o.close()


# ---------------------------------------------------------------- 3: AdamW checkpoints
@pytest.mark.parametrize("flags", [dict(fused=True), dict(foreach=True),
                                   dict(foreach=False, capturable=False, differentiable=False)])
def test_an_adamw_checkpoint_loads_whatever_kernel_it_chose(flags):
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)
    for x in batches(3):
        adamw.zero_grad()
        loss_fn(model, x).backward()
        adamw.step()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
    opt.load_state_dict(adamw.state_dict())
    assert not any(k in g for g in opt.param_groups for k in flags)
    run(model, opt, batches(2))
    opt.close()


def test_a_group_count_mismatch_says_how_to_build_matching_groups():
    model = make_model()
    params = list(model.parameters())
    adamw = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:],
                                                         "weight_decay": 0.0}])
    opt = ZenFlowOptimizer(model.named_parameters(), **SPLIT)
    with pytest.raises(ValueError, match="groups it was saved with.*trainer_kwargs"):
        opt.load_state_dict(adamw.state_dict())
    opt.close()


# ---------------------------------------------------------------- 5: Ctrl-C under any handler
def interrupted_run(steps: int, handler) -> tuple[list[torch.Tensor], int]:
    """``steps`` steps under ``handler`` for SIGINT, which a timer thread sends every 1-4 ms
    while a step() runs; every KeyboardInterrupt is caught and the loop goes on from
    ``stats()["steps"]``. (Signals are sent only while step() runs, and each lands before
    the loop leaves its try: the harness itself must survive them.)"""
    import random

    data = batches(steps, seed=3)
    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, select_interval=8, **SPLIT)
    lock, state, stop = threading.Lock(), {"armed": False}, threading.Event()
    rng, main, hits = random.Random(0), threading.main_thread().ident, [0]

    def fire():
        while not stop.is_set():
            time.sleep(rng.uniform(0.001, 0.004))
            with lock:
                if state["armed"]:
                    # at the main thread: a process-wide kill may be taken by a thread that
                    # is not running on a loaded machine, and land after the loop's try
                    signal.pthread_kill(main, signal.SIGINT)

    def arm(on: bool) -> None:
        while True:  # an interrupt may land here too: it counts, and arming goes on
            try:
                with lock:
                    state["armed"] = on
                time.sleep(0.001)  # a signal sent before the lock was ours lands here
                return
            except KeyboardInterrupt:
                hits[0] += 1

    old = signal.signal(signal.SIGINT, handler)
    timer = threading.Thread(target=fire, daemon=True)
    timer.start()
    try:
        while opt.stats()["steps"] < steps:
            x = data[opt.stats()["steps"]]
            opt.zero_grad()
            loss_fn(model, x).backward()
            try:
                arm(True)
                try:
                    opt.step()
                finally:
                    arm(False)
            except KeyboardInterrupt:
                hits[0] += 1
    finally:
        stop.set()
        timer.join()
        signal.signal(signal.SIGINT, old)
    opt.close()
    return params_of(model), hits[0]


def raising_handler(signum, frame):
    raise KeyboardInterrupt("graceful stop")


@pytest.mark.parametrize("handler", [signal.default_int_handler, raising_handler],
                         ids=["default", "user"])
def test_random_ctrl_c_ends_bit_exact(handler):
    data = batches(60, seed=3)
    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, select_interval=8, **SPLIT)
    run(model, opt, data)
    opt.close()
    params, hits = interrupted_run(60, handler)
    assert hits > 0, "no interrupt landed: the test tested nothing"
    assert same_tensors(params_of(model), params)


# ---------------------------------------------------------------- 6: a layer frozen mid-window
def test_a_layer_frozen_mid_window_gets_its_given_gradients_then_stays():
    """Gradients given before the freeze reach the layer (as AdamW applied them), at the apply
    points of the windows that hold them; after that it does not change. It lands where a run
    that finished at the freeze puts it."""
    data = batches(16)
    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
    run(model, opt, data[:6])  # a window holds 2 gradients
    frozen = model.fc1.weight
    frozen.requires_grad_(False)
    seen = [frozen.detach().clone()]
    for x in data[6:]:
        opt.zero_grad()
        loss_fn(model, x).backward()
        opt.step()
        seen.append(frozen.detach().clone())
    opt.finish()
    seen.append(frozen.detach().clone())
    changes = [6 + i for i in range(1, len(seen)) if not torch.equal(seen[i - 1], seen[i])]
    # frozen after step 6: the window of steps 1-4 lands at step 8, that of steps 5-6 at 12
    assert changes == [8, 12], f"the frozen layer changed after steps {changes}"
    opt.close()

    model_b = make_model()
    opt_b = ZenFlowOptimizer(model_b.named_parameters(), lr=1e-2, **SPLIT)
    run(model_b, opt_b, data[:6])
    opt_b.finish()
    assert torch.equal(model_b.fc1.weight, seen[-1])
    opt_b.close()


# ---------------------------------------------------------------- 7: early, clear errors
def test_triton_backend_on_cpu_params_fails_at_construction(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = make_model()
    with pytest.raises(ValueError, match="CUDA or ROCm device"):
        ZenFlowOptimizer(model.named_parameters(), backend="triton")


def test_settings_that_cannot_be_meant_are_named():
    model = make_model()
    with pytest.raises(ValueError, match="host_threads=1000"):
        ZenFlowOptimizer(model.named_parameters(), host_threads=1000)
    with pytest.warns(UserWarning, match="match no param name"):
        ZenFlowOptimizer(model.named_parameters(), dense_params=("*embedding*",)).close()
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        ZenFlowOptimizer(model.named_parameters(), amsgrad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZenFlowOptimizer(model.named_parameters(), fused=True, foreach=False).close()


def test_torch_compile_of_step_runs_eagerly_without_recompiling():
    import torch._dynamo

    torch._dynamo.reset()
    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
    step = torch.compile(opt.step)
    before = dict(torch._dynamo.utils.counters["stats"])
    for x in batches(12):
        opt.zero_grad()
        loss_fn(model, x).backward()
        step()
    traced = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0) - \
        before.get("unique_graphs", 0)
    assert traced == 0, f"Dynamo traced {traced} graphs of the step"
    assert opt.stats()["steps"] == 12
    opt.close()


def test_the_callback_does_not_finish_onto_a_reloaded_best_model():
    """With load_best_model_at_end the Trainer has put a checkpoint's weights in the model
    (not its optimizer state): the callback then warns instead of applying this run's work."""
    import types

    model = make_model()
    opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
    run(model, opt, batches(6))
    before = params_of(model)
    args = types.SimpleNamespace(load_best_model_at_end=True)
    state = types.SimpleNamespace(best_model_checkpoint="out/checkpoint-4")
    with pytest.warns(UserWarning, match="checkpoint-4"):
        ZenFlowCallback().on_train_end(args, state, None, optimizer=opt)
    assert same_tensors(before, params_of(model))
    ZenFlowCallback().on_train_end(types.SimpleNamespace(load_best_model_at_end=False), state,
                                   None, optimizer=opt)
    assert not same_tensors(before, params_of(model))  # otherwise it finishes
    opt.close()


# ---------------------------------------------------------------- 8: a schedule that ends at 0
@pytest.mark.parametrize("resume", [False, True])
def test_finish_under_a_linear_decay_to_zero_applies_the_last_window_at_its_steps_lr(resume):
    """A window takes the hyperparameters of the step that closes it. finish() closes the
    open window after the loop, when the scheduler has already written the next step's lr
    (0 at the end of a linear decay): it must launch at the last step's, not drop the
    window's host-owned gradients at lr 0. Same after a save and load at the end."""
    data = batches(10)

    def train(step_scheduler_at_end: bool):
        model = make_model()
        opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (10 - s) / 10)
        for i, x in enumerate(data):
            opt.zero_grad()
            loss_fn(model, x).backward()
            opt.step()
            if step_scheduler_at_end or i < len(data) - 1:
                sched.step()
        if resume:
            sd = opt.state_dict()
            opt.close(finish=False)
            opt = ZenFlowOptimizer(model.named_parameters(), lr=1e-2, **SPLIT)
            opt.load_state_dict(sd)
        before = params_of(model)
        opt.finish()
        after = params_of(model)
        opt.close()
        return before, after, opt.param_groups[0]["lr"]

    before, after, lr = train(True)
    assert lr == 0.0  # the scheduler ended at 0: the lr a later step would have
    assert not same_tensors(before, after), "finish() applied the open window at lr 0"
    _, want, _ = train(False)  # the lr left at the last step's
    assert same_tensors(after, want)
