"""ZenFlowConfig: every setting of the optimizer that is not a per-group hyperparameter.

One frozen dataclass, validated up front: a bad value fails at construction with a message
that names the field and the allowed range, never later inside a step.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import numbers
from dataclasses import dataclass, fields
from typing import Any, Literal, Union, get_args

import torch

Backend = Literal["auto", "torch", "triton"]
Score = Literal["l2", "l1"]
AccumulateOn = Literal["device", "host"]
StateDtype = Literal["float32", "bfloat16"]
FiniteCheckAt = Literal["auto", "step", "boundary"]
HostBetas = Literal["step", "window"]

DEFAULT_CHUNK_SIZE = 1 << 22  # 4M fp32 elements = 16 MiB per staging buffer
DEFAULT_MIN_OFFLOAD_NUMEL = 4096
DEFAULT_SELECT_INTERVAL_WINDOWS = 16  # select_interval=None -> 16 update windows
# The dense set's default: embeddings and the LM head, by the names transformers, GPT-2 style
# and most hand-written models give them (model.embed_tokens, word_embeddings, wte, wpe,
# lm_head). The layers that infrequent updates hurt most (docs/design.md, "The dense set").
DEFAULT_DENSE_PARAMS = ("*embed*", "*lm_head*", "*wte*", "*wpe*")


class ConfigError(ValueError):
    """A ZenFlowConfig field holds a value outside its allowed range."""


@dataclass(frozen=True)
class ZenFlowConfig:
    """Settings of a :class:`~zenflow_triton.ZenFlowOptimizer` (docs/design.md, "The step")."""

    topk_ratio: float = 0.1
    """Fraction of each matrix param's columns updated on the device every step, in [0, 1].
    0 sends every column to the host (ZeRO-Offload when update_interval=1, overlap=False);
    1 keeps every column on the device (plain AdamW)."""

    update_interval: int = 4
    """Steps per host window (>= 1): host-owned columns accumulate their gradient for this many
    steps, then get one host AdamW step on the window-mean gradient."""

    select_interval: int | None = None
    """Steps between column reselections; a positive multiple of update_interval.
    None means 16 * update_interval."""

    overlap: bool = True
    """True: the host result of the window ending at step t is applied at t + apply_delay
    (the host works while the device trains). False: it is applied at t (synchronous)."""

    apply_delay: int | None = None
    """With overlap=True, the steps (1 to update_interval) after a window's last step at
    whose end its host result is written into the params: the host has that many steps of
    device time to hide behind, and the deferred columns are that many steps stale. None =
    update_interval (the next boundary). A shorter delay buys back most of what staleness
    costs in quality where the host keeps up (docs/quality.md); where it does not, the
    device waits (``zenflow-tune predict`` models it)."""

    warmup_steps: int = 0
    """Steps (>= 0) of synchronous full host updates before the first selection."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    """Most elements (>= 1) of one host AdamW kernel call per tensor. A window whose result
    applies at once (overlap=False, warm-up) streams through pieces of at most
    min(chunk_size, 2^19) elements, so each host worker stages at most that much; results
    never depend on it (docs/host.md)."""

    min_offload_numel: int = DEFAULT_MIN_OFFLOAD_NUMEL
    """Matrix params (dim >= 2) with at least this many elements (>= 1) are split by columns;
    smaller ones and all 1-D params are device-owned entirely."""

    dense_params: tuple[str, ...] = DEFAULT_DENSE_PARAMS
    """Name patterns (``fnmatch``, case-insensitive, matched against the whole name) of
    matrix params kept whole on the device and updated by AdamW every step, never split:
    by default embeddings and the LM head, which deferred updates hurt most. Names come from
    ``(name, tensor)`` pairs (``model.named_parameters()``) or a group's ``param_names``; an
    unnamed param matches nothing. Costs device memory: their Adam moments (and an fp32
    master for a low-precision param) live on the device (``stats()``, docs/memory.md).
    ``()`` splits every matrix."""

    accumulate_on: AccumulateOn = "device"
    """Where the gradient of host-owned columns is summed over a window: "device" (one
    transfer per window) or "host" (one transfer per step, less device memory)."""

    stream_grads: bool = False
    """True: each matrix param's gradient leaves the device as backward makes it (a
    post-accumulate-grad hook per param, in place from construction): its host-owned columns
    go to the host, its device-owned columns to a small device buffer, and ``.grad`` is freed
    at once, so no full gradient of the model is ever resident on the device (about one
    matrix's at a time; ``stats()["grad_bytes_peak"]``). Implies accumulate_on="host".
    ``.grad`` of a matrix param then reads None after backward: clip with ``max_grad_norm``,
    not ``clip_grad_norm_`` (docs/design.md, "Gradient streaming"). Not under DDP or FSDP2."""

    max_grad_norm: float | None = None
    """Clip by the global norm in step() (> 0; None: no clipping): every gradient the step
    takes, device- and host-owned columns and small params alike, is scaled by
    ``min(1, max_grad_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does. The
    way to clip under ``stream_grads``, where a framework's own clipping sees no gradients."""

    host_state_dtype: StateDtype = "float32"
    """Dtype of the host moments m and v: "float32", or "bfloat16" (2 B less per moment per
    host-owned element; each host step rounds them to nearest once). The host master is
    always fp32. Its cost in quality is measured in the README ("Memory")."""

    accumulator_dtype: StateDtype = "float32"
    """Dtype of the window accumulator (on the device, or on the host with
    accumulate_on="host"): "float32", or "bfloat16" (half the bytes; each step's sum is
    rounded to nearest). Its cost in quality is measured in the README ("Memory")."""

    score: Score = "l2"
    """Column importance: "l2" = sum of squared gradients per column, "l1" = sum of |g|."""

    backend: Backend = "auto"
    """Kernel backend for the device half: "triton", "torch" (reference), or "auto"
    (triton where params live on a CUDA/ROCm device, torch elsewhere)."""

    host_threads: int | None = None
    """Threads (>= 1) of the host AdamW pool; None = torch.get_num_threads()."""

    host_cores: tuple[int, ...] | None = None
    """CPU cores the host AdamW threads are pinned to, e.g. cores the training loop does not
    use (Linux); None = no pinning (default). Never fatal: unusable cores only warn."""

    host_lr_scale: Union[float, Literal["auto", "sqrt", "adaptive"]] = "adaptive"
    """Host learning-rate multiplier of a window after warm-up, for a param that accumulated
    n gradients in it (n = update_interval for a full window). "adaptive" (the default):
    between sqrt(n) and n by the signal fraction of the window mean, estimated per param from
    its host moments before each host step, and at most what keeps one host step within 1% of
    the weights' RMS, never below 1 (``host.step_size``; 1 when n = 1): as far as n AdamW
    steps would drift, never farther (docs/design.md, "The host step size"). "sqrt":
    min(sqrt(n), SQRT_SCALE_CAP = 2), AdamW's travel when gradient noise dominates (the
    default before "adaptive"). "auto": n, AdamW's travel when the gradient is steady; it
    overshoots and diverged at long windows. A number x > 0: x for every window; 1.0 is
    ZenFlow's and DeepSpeed's semantics (one ordinary AdamW step per window), which lags
    AdamW at fine-tuning learning rates. Warm-up steps are plain AdamW: multiplier 1
    whatever this is."""

    host_betas: HostBetas = "step"
    """How much a host window decays the host moments m and v. "step": by the group's betas,
    once per window, as one AdamW step would: the moments remember ``n`` times as many
    gradients as AdamW's (beta1 = 0.9: 10 windows, 40 gradients at n = 4). "window": by
    ``beta ** n`` for a window of ``n`` gradients, as ``n`` AdamW steps would (bias corrections
    counted in gradients): they remember as many gradients as AdamW's. The same for n = 1
    (warm-up, update_interval=1). Its effect on quality is measured in docs/quality.md
    ("The moments' horizon")."""

    fresh_if_spread: bool = True
    """Measured once, at the first selection: the share of the gradient's squared norm in
    the top 10% of the columns of every matrix of the model, split or kept whole by the
    dense set (element-weighted mean, ``zenflow-tune diagnose``'s number; ``columns.spread``).
    Below 0.5 the gradient is spread (the encoder fine-tunes where the stale default ended up
    to 0.034 nats and 2.6 accuracy points behind AdamW; docs/quality.md, "Spread gradients"),
    and True then trains with ``host_betas="window"`` and ``apply_delay=1``, fresher host
    columns for more step time, where the config is that default (``host_betas="step"``,
    ``apply_delay`` None, ``overlap``, ``update_interval`` > 1); a concentrated gradient
    (the LMs: 0.57-0.64) keeps it. False: the config as given. Either way a spread gradient
    under a stale config is warned about once. Measured beside it, the *window travel*
    (``update_interval`` x the lr, a scheduler's ``initial_lr`` where larger, / the split
    matrices' weight RMS): over 1e-3 a stale config is warned about once, and kept (Gemma
    3 270M at 2e-5 travels 2.3e-3, where the default lost 0.034 nats; SmolLM2-135M at 1e-4
    2.1e-3, where it ended 0.008 ahead and the fresh pair 0.020 behind; docs/quality.md,
    "The window's travel"). ``stats()["spread"]`` says what was measured and chosen
    (``share``, ``spread``, ``travel``, ``far``, ``fresh``); a checkpoint carries it."""

    check_finite: bool = True
    """True: step() raises NonFiniteGradientError on a NaN/inf gradient before it changes any
    state. False: non-finite values flow into the update as in torch.optim.AdamW."""

    check_finite_at: FiniteCheckAt = "auto"
    """When the NaN/inf check is read on the host. "step": every step, at the bad step itself
    (one host sync a step). "boundary": only at steps that wait for the device anyway (window
    boundaries, reselections, warm-up, a param's first step) and in state_dict() and
    synchronize(); a bad gradient at another step masks its update on the device (the
    kernels read a device flag) and every update after it, and the next such step raises,
    naming the step, with the step count rolled back: state as after the step before the
    bad one. Needs backend "triton" and accumulate_on="device". "auto": "boundary" where
    that holds and a param is on a CUDA device, else "step" (a CPU read costs nothing)."""

    host_timeout: float = 600.0
    """Seconds (> 0) any wait for host work may take before it raises TimeoutError."""

    def __post_init__(self) -> None:
        _check_number("topk_ratio", self.topk_ratio, float, lo=0.0, hi=1.0, rng="[0, 1]")
        _check_number("update_interval", self.update_interval, int, lo=1, rng=">= 1")
        if self.select_interval is not None:
            _check_number("select_interval", self.select_interval, int, lo=1,
                          rng="a positive multiple of update_interval")
            if self.select_interval % self.update_interval != 0:
                raise ConfigError(
                    f"select_interval={self.select_interval} must be a positive multiple of "
                    f"update_interval={self.update_interval}"
                )
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be a bool, got {self.overlap!r}")
        if self.apply_delay is not None:
            _check_number("apply_delay", self.apply_delay, int, lo=1, hi=self.update_interval,
                          rng=f"in [1, update_interval={self.update_interval}] or None")
            if not self.overlap:
                raise ConfigError("apply_delay needs overlap=True (overlap=False applies each "
                                  "window's result at its own boundary)")
        if not isinstance(self.check_finite, bool):
            raise ConfigError(f"check_finite must be a bool, got {self.check_finite!r}")
        _check_number("warmup_steps", self.warmup_steps, int, lo=0, rng=">= 0")
        _check_number("chunk_size", self.chunk_size, int, lo=1, rng=">= 1")
        _check_number("min_offload_numel", self.min_offload_numel, int, lo=1, rng=">= 1")
        dense = self.dense_params
        if (isinstance(dense, (str, bytes)) or not hasattr(dense, "__iter__")
                or not all(isinstance(x, str) and x for x in dense)):
            raise ConfigError("dense_params must be a sequence of non-empty name patterns "
                              f"(fnmatch, e.g. ('*embed*', '*lm_head*')), got {dense!r}")
        object.__setattr__(self, "dense_params", tuple(dense))  # lists from JSON
        _check_choice("accumulate_on", self.accumulate_on, AccumulateOn)
        if not isinstance(self.stream_grads, bool):
            raise ConfigError(f"stream_grads must be True or False, got {self.stream_grads!r}")
        if self.stream_grads:  # the host columns leave during backward: summed on the host
            object.__setattr__(self, "accumulate_on", "host")
        if self.max_grad_norm is not None:
            _check_number("max_grad_norm", self.max_grad_norm, float, lo=0.0, lo_open=True,
                          rng="> 0 or None")
        _check_choice("check_finite_at", self.check_finite_at, FiniteCheckAt)
        if self.check_finite_at == "boundary" and self.accumulate_on != "device":
            raise ConfigError('check_finite_at="boundary" needs accumulate_on="device": a host '
                              'accumulation cannot be masked on the device')
        _check_choice("host_state_dtype", self.host_state_dtype, StateDtype)
        _check_choice("accumulator_dtype", self.accumulator_dtype, StateDtype)
        _check_choice("score", self.score, Score)
        _check_choice("host_betas", self.host_betas, HostBetas)
        if not isinstance(self.fresh_if_spread, bool):
            raise ConfigError(f"fresh_if_spread must be True or False, got "
                              f"{self.fresh_if_spread!r}")
        _check_choice("backend", self.backend, Backend)
        self._check_host()

    def _check_host(self) -> None:
        """The host side's fields: threads, cores, the host step size, the timeout."""
        if self.host_threads is not None:
            _check_number("host_threads", self.host_threads, int, lo=1, rng=">= 1 or None")
        if self.host_cores is not None:
            cores = self.host_cores
            if (isinstance(cores, (str, bytes)) or not hasattr(cores, "__iter__")
                    or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                               for c in cores) or len(tuple(cores)) == 0):
                raise ConfigError("host_cores must be None or a non-empty sequence of core "
                                  f"numbers >= 0, got {cores!r}")
            object.__setattr__(self, "host_cores", tuple(cores))  # lists from JSON profiles
        if self.host_lr_scale not in ("auto", "sqrt", "adaptive"):
            _check_number("host_lr_scale", self.host_lr_scale, float, lo=0.0, lo_open=True,
                          rng='> 0, "auto", "sqrt" or "adaptive"')
        _check_number("host_timeout", self.host_timeout, float, lo=0.0, lo_open=True, rng="> 0")

    # ---- derived values -------------------------------------------------------------
    @property
    def effective_select_interval(self) -> int:
        if self.select_interval is None:
            return DEFAULT_SELECT_INTERVAL_WINDOWS * self.update_interval
        return self.select_interval

    @property
    def effective_apply_delay(self) -> int:
        """Steps after its window's last step at which an overlapped result is applied."""
        return self.update_interval if self.apply_delay is None else self.apply_delay

    @property
    def stale_default(self) -> bool:
        """The schedule ``fresh_if_spread`` may freshen: the step's betas, a result applied
        a whole window after its gradients (``overlap``, ``update_interval`` > 1)."""
        return (self.host_betas == "step" and self.effective_apply_delay > 1
                and self.overlap and self.update_interval > 1)

    def is_dense(self, name: str | None) -> bool:
        """Whether a param of this name is in the dense set (``dense_params``)."""
        return matches_any(name, self.dense_params)

    @property
    def effective_host_lr_scale(self) -> float:
        """The host lr multiplier of a full window (update_interval gradients) after warm-up
        (1 under "adaptive", which the host job resolves: ``host.step_size``)."""
        from .host.step_size import fixed_multiplier  # lazy: the host package imports config

        return fixed_multiplier(self.host_lr_scale, self.update_interval)

    @property
    def host_moment_dtype(self):
        """``host_state_dtype`` as a torch dtype."""
        return _TORCH_DTYPES[self.host_state_dtype]

    @property
    def accumulator_torch_dtype(self):
        """``accumulator_dtype`` as a torch dtype."""
        return _TORCH_DTYPES[self.accumulator_dtype]

    def replace(self, **changes: Any) -> "ZenFlowConfig":
        """A copy with some fields changed (validated like a new config)."""
        unknown = set(changes) - set(self.field_names())
        if unknown:
            raise ConfigError(f"unknown ZenFlowConfig field(s): {sorted(unknown)}; "
                              f"known: {self.field_names()}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Primitives only (safe for state_dict and JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ZenFlowConfig":
        unknown = set(d) - set(cls.field_names())
        if unknown:
            raise ConfigError(f"unknown ZenFlowConfig field(s): {sorted(unknown)}; "
                              f"known: {cls.field_names()}")
        return cls(**d)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def of(cls, config: "ZenFlowConfig | None", fields_: dict[str, Any]) -> "ZenFlowConfig":
        """The optimizer's config: ``config``, or one built from its fields given as keywords
        (not both; an unknown keyword is a TypeError, as for any function)."""
        if config is not None and fields_:
            raise TypeError("give either config=ZenFlowConfig(...) or its fields as keywords, "
                            f"not both (got config and {sorted(fields_)})")
        unknown = set(fields_) - set(cls.field_names())
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; "
                            f"ZenFlowConfig fields are {cls.field_names()}")
        return config if config is not None else cls(**fields_)


def matches_any(name: str | None, patterns: tuple[str, ...]) -> bool:
    """Whether ``name`` matches one of the fnmatch ``patterns``, case-insensitively (the
    dense set's rule; no name matches nothing)."""
    if not name:
        return False
    low = name.lower()
    return any(fnmatch.fnmatchcase(low, pat.lower()) for pat in patterns)


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_hyper(lr, betas, eps, weight_decay, where: str) -> None:
    """ValueError naming ``where`` for an AdamW hyperparameter out of range (a Tensor lr
    included: torch's AdamW without fused/capturable refuses it too)."""
    if isinstance(lr, torch.Tensor):
        raise ValueError(f"{where}: lr as a Tensor is not supported; give a float")
    for field, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        _number(where, field, value)
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__"):
        raise TypeError(f"{where}: betas must be two numbers in [0, 1), e.g. (0.9, 0.999); "
                        f"got {betas!r}")
    for b in betas:
        _number(where, "betas", b)
    if not 0.0 <= lr:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: eps must be >= 0, got {eps}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be two values in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay}")


def _number(where: str, field: str, value: Any) -> None:
    """TypeError naming the field where an AdamW hyperparameter is not a real number (a
    string from a YAML or JSON config included: torch's AdamW would fail on a comparison)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = (f" (a string: write {value} without quotes, or float({value!r}))"
                if isinstance(value, str) else "")
        raise TypeError(f"{where}: {field} must be a number, got {value!r}{hint}")


def _check_number(name: str, value: Any, kind: type, *, lo: float | None = None,
                  hi: float | None = None, lo_open: bool = False, rng: str) -> None:
    ok_type = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{name} must be {'a number' if kind is float else 'an int'} ({rng}), "
                          f"got {value!r}")
    if value != value:  # NaN
        raise ConfigError(f"{name} must be {rng}, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ConfigError(f"{name} must be {rng}, got {value!r}")
    if hi is not None and value > hi:
        raise ConfigError(f"{name} must be {rng}, got {value!r}")


def _check_choice(name: str, value: Any, lit: Any) -> None:
    allowed = get_args(lit)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
