"""The HF Trainer with ZenFlow: :func:`trainer_kwargs` builds the optimizer and the callback.

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds,
                                   **trainer_kwargs(model, args, topk_ratio=0.1))
    trainer.train()
    trainer.save_model(out_dir)       # every gradient applied: the callback finished training

What :class:`ZenFlowCallback` does, and why the Trainer needs it:

* at the end of ``train()`` it calls ``ZenFlowOptimizer.finish()``: the open window goes to
  the host and every host result is applied, so ``trainer.save_model()`` writes weights that
  hold every gradient;
* under data parallelism the Trainer calls ``optimizer.state_dict()`` on rank 0 only, but a
  ZenFlow state dict gathers every rank's rows of the host halves (a collective): at the end
  of a step that will save (``control.should_save``) every rank gathers it through
  ``ZenFlowOptimizer.prepare_state_dict``, and rank 0's ``state_dict()`` returns that.

A mid-training checkpoint (``checkpoint-N/``) is written without changing the trajectory: its
``optimizer.pt`` holds the host work still pending (a resume from it equals the uninterrupted
run, bit for bit), and its ``model.safetensors`` holds the weights as they are at step N, so
the host-owned columns lack the windows not yet applied (at most two windows of gradients).
For an inference-ready copy of a checkpoint, resume from it and finish:
``trainer.train(resume_from_checkpoint=path)`` with ``max_steps`` at its step, then
``trainer.save_model()``. Importing this module needs ``transformers``; the library does not
otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

from .checkpoint.state_dict import without_kernel_choices
from .config import ZenFlowConfig
from .fit import DoesNotFitError, check, profile_settings
from .optimizer import ZenFlowOptimizer


def _zenflow(optimizer) -> ZenFlowOptimizer | None:
    """The ZenFlowOptimizer inside the Trainer's optimizer (Accelerate wraps it)."""
    seen = 0
    while optimizer is not None and seen < 4:
        if isinstance(optimizer, ZenFlowOptimizer):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


class ZenFlowCallback(TrainerCallback):
    """Finishes training at the end of ``train()``; gathers the ZenFlow state dict on every
    rank before the Trainer saves a checkpoint."""

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save and not args.save_only_model:
            opt = _zenflow(optimizer)
            if opt is not None:
                opt.prepare_state_dict()
        return control

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        opt = _zenflow(optimizer)
        if opt is None:
            return control
        if args.load_best_model_at_end and state.best_model_checkpoint:
            # The Trainer put the best checkpoint's weights in the model, not its optimizer
            # state: applying this run's pending work to them would mix two states.
            warnings.warn("ZenFlowCallback: load_best_model_at_end loaded the weights of "
                          f"{state.best_model_checkpoint}; its host-owned columns lag by up to "
                          "two windows (resume from it and finish to complete them)",
                          UserWarning, stacklevel=2)
            return control
        opt.finish()
        return control


def trainer_kwargs(model, args=None, *, profile: str | None = None,
                   **zenflow: Any) -> dict[str, Any]:
    """``optimizers`` and ``callbacks`` for ``transformers.Trainer``: a ZenFlowOptimizer over
    the model's named params (so the dense set applies), in the Trainer's own two groups
    (weight decay on every param but biases and norm weights, then those without), with the
    hyperparameters of ``args`` (``TrainingArguments``: learning_rate, weight_decay, adam
    betas and epsilon) and a profile's settings (``profile``) or ZenFlow settings given as
    keywords (which win); and :class:`ZenFlowCallback`. The Trainer makes the lr schedule.
    With ``stream_grads=True`` the Trainer's gradient clipping moves into the optimizer
    (``max_grad_norm``; ``args.max_grad_norm`` set to 0, with a warning)."""
    from transformers import Trainer

    hyper = {}
    if args is not None:
        hyper = dict(lr=args.learning_rate, weight_decay=args.weight_decay,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    hyper.update({k: zenflow.pop(k) for k in ("lr", "weight_decay", "betas", "eps")
                  if k in zenflow})
    if "lr" not in hyper:
        # the Trainer's scheduler scales the optimizer's own lr: without args or lr= the run
        # would train at ZenFlowOptimizer's default, not the TrainingArguments' learning_rate
        warnings.warn("trainer_kwargs got neither TrainingArguments (args) nor lr=: the "
                      "optimizer trains at ZenFlowOptimizer's default lr=1e-3, not your "
                      "TrainingArguments.learning_rate; pass trainer_kwargs(model, args)",
                      UserWarning, stacklevel=2)

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    wd = hyper.pop("weight_decay", 0.0)
    groups = [{"params": [(n, p) for n, p in named if n in decay], "weight_decay": wd},
              {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    settings = profile_settings(profile, zenflow) if profile is not None else dict(zenflow)
    cfg = _streaming_config(groups, settings)
    if cfg is not None and args is not None and args.max_grad_norm and cfg.max_grad_norm is None:
        # streaming (asked for, or a profile's, or the fit's): the Trainer's clip_grad_norm_
        # would see only the small params' .grad (the matrices' left during backward), so
        # the optimizer clips by the global norm instead
        if "config" in settings:
            settings["config"] = cfg.replace(max_grad_norm=float(args.max_grad_norm))
        else:
            settings["max_grad_norm"] = float(args.max_grad_norm)
        warnings.warn(f"trainer_kwargs: stream_grads moves max_grad_norm="
                      f"{args.max_grad_norm} from the Trainer into the optimizer (set "
                      "args.max_grad_norm = 0), which clips every gradient by the global norm",
                      UserWarning, stacklevel=2)
        args.max_grad_norm = 0.0
    try:
        opt = ZenFlowOptimizer(groups, **hyper, **settings)
    except DoesNotFitError as e:  # (as from_profile names it)
        if profile is None:
            raise
        raise type(e)(f"profile {profile!r}: {e}") from None
    return {"optimizers": (opt, None), "callbacks": [ZenFlowCallback()]}


def _streaming_config(groups: list[dict], settings: dict[str, Any]) -> ZenFlowConfig | None:
    """The config the optimizer these keywords build will run, where it streams (asked for,
    a profile's, or taken by ``fit="lean"``: ``fit.check`` says so without a warning); None
    where it does not, or where the constructor will raise anyway (it says why)."""
    try:
        fields = without_kernel_choices({k: v for k, v in settings.items() if k not in (
            "config", "fit", "process_group")}, "keyword arguments")
        cfg = ZenFlowConfig.of(settings.get("config"), fields)
        if not cfg.stream_grads and settings.get("fit") == "lean":
            cfg = cfg.replace(**check(groups, cfg, "lean"))
    except (TypeError, ValueError):  # (DoesNotFitError and ConfigError among them)
        return None
    return cfg if cfg.stream_grads else None


__all__ = ["ZenFlowCallback", "trainer_kwargs"]
