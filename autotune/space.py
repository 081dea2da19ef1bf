"""The search space: which ZenFlowConfig settings the tuner tries, and within what ranges.

Every suggestion is built into a :class:`~zenflow_triton.ZenFlowConfig` before it is used, so
it is valid by construction (``select_interval`` is sampled as a number of update windows and
multiplied by ``update_interval``, so it is always a multiple of it).

Parameters (Optuna names):

* ``topk_ratio``        float, log scale, ``[topk_min, topk_max]``
* ``update_interval``   int, log scale, ``[1, update_interval_max]``
* ``select_windows``    int, log scale: ``select_interval = select_windows * update_interval``
* ``chunk_log2``        int: ``chunk_size = 2 ** chunk_log2`` elements
* ``host_threads``      int, ``[1, max_host_threads]``
* ``host_lr_rule``      categorical: ``"adaptive"`` (``host_lr_scale="adaptive"``, the
  multiplier resolved per window from the host moments) or ``"power"``:
* ``host_lr_exponent``  float in [0, 1], only under ``"power"``: ``host_lr_scale =
  update_interval ** e``, from 1.0 (ZenFlow / DeepSpeed semantics, e = 0) through
  sqrt(update_interval) (the "sqrt" rule below its cap, e = 0.5) to ``"auto"``
  (= update_interval, e = 1);

with ``search_host_lr=False`` the library default.

* ``apply_delay_share`` categorical over ``apply_delays``, only when that is not ``(1.0,)``,
  ``overlap`` is on and ``update_interval > 1``: ``apply_delay =``
  :func:`apply_delay_for` ``(share, update_interval)`` (a share of 1.0 is the default
  schedule, each result at the next boundary).
* ``host_betas`` categorical over ``host_betas``, only when that has more than one value
  and ``update_interval > 1`` (at 1 every value is the same computation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, get_args

from zenflow_triton import ZenFlowConfig
from zenflow_triton.config import HostBetas
from zenflow_triton.host.step_size import fixed_multiplier

from .detect import usable_cpus

__all__ = ["SearchSpace", "HOST_LR_RULES", "apply_delay_for", "betas_values", "delay_steps"]

HOST_LR_RULES = ("adaptive", "power")


def apply_delay_for(share: float, update_interval: int) -> int | None:
    """``ZenFlowConfig.apply_delay`` for a share of the update interval in (0, 1]:
    ``round(share * update_interval)`` clamped to ``[1, update_interval]``, and None (the
    default schedule, the same arithmetic) where that is the whole interval."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"an apply delay share is in (0, 1], got {share!r}")
    d = max(1, min(update_interval, round(share * update_interval)))
    return None if d == update_interval else d


def betas_values(values) -> tuple[str, ...]:
    """Distinct ``ZenFlowConfig.host_betas`` values to search, in the order given
    (ValueError naming the allowed ones for anything else, or none)."""
    allowed = get_args(HostBetas)
    vals = tuple(dict.fromkeys(values))
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise ValueError(f"host_betas values to search are {list(allowed)}, got "
                         f"{list(values)!r}")
    return vals


def delay_steps(settings: dict[str, Any]) -> int:
    """The apply delay in steps of a settings dict (``apply_delay`` None, or absent: the
    update interval, as ``ZenFlowConfig.effective_apply_delay``)."""
    return settings.get("apply_delay") or settings["update_interval"]


@dataclass(frozen=True)
class SearchSpace:
    topk_min: float = 0.01
    topk_max: float = 0.5
    update_interval_max: int = 16
    select_windows_min: int = 1
    select_windows_max: int = 32
    chunk_log2_min: int = 16
    chunk_log2_max: int = 24
    max_host_threads: int | None = None
    """None = the CPUs this process may use."""
    search_host_lr: bool = True
    overlap: bool = True
    dense_params: tuple[str, ...] | None = None
    """Fixed for every trial: ZenFlow's dense set (name patterns); None = the library's."""
    apply_delays: tuple[float, ...] = (1.0,)
    """``apply_delay`` shares of the update interval to search (see :func:`apply_delay_for`);
    the default, ``(1.0,)``, searches nothing: every trial keeps the default schedule.
    Ignored without ``overlap``."""
    host_betas: tuple[str, ...] | None = None
    """``ZenFlowConfig.host_betas`` values to search ("step", "window"); None = the
    library's default for every trial."""

    def __post_init__(self) -> None:
        if not 0.0 < self.topk_min <= self.topk_max <= 1.0:
            raise ValueError(f"need 0 < topk_min <= topk_max <= 1, got "
                             f"[{self.topk_min}, {self.topk_max}]")
        if self.update_interval_max < 1:
            raise ValueError(f"update_interval_max must be >= 1, got {self.update_interval_max}")
        if not 1 <= self.select_windows_min <= self.select_windows_max:
            raise ValueError("need 1 <= select_windows_min <= select_windows_max")
        if not 0 <= self.chunk_log2_min <= self.chunk_log2_max <= 40:
            raise ValueError("need 0 <= chunk_log2_min <= chunk_log2_max <= 40")
        if self.max_host_threads is not None and self.max_host_threads < 1:
            raise ValueError("max_host_threads must be >= 1")
        shares = tuple(self.apply_delays)
        if not shares or not all(isinstance(f, (int, float)) and 0.0 < f <= 1.0
                                 for f in shares):
            raise ValueError(f"apply_delays are shares of the update interval in (0, 1], "
                             f"got {self.apply_delays!r}")
        if len(set(shares)) != len(shares):
            raise ValueError(f"apply_delays has repeats: {self.apply_delays!r}")
        object.__setattr__(self, "apply_delays", tuple(float(f) for f in shares))
        if self.host_betas is not None:
            object.__setattr__(self, "host_betas", betas_values(self.host_betas))

    @property
    def searches_host_betas(self) -> bool:
        return self.host_betas is not None and len(self.host_betas) > 1

    @property
    def searches_apply_delay(self) -> bool:
        return self.overlap and self.apply_delays != (1.0,)

    @property
    def host_threads_max(self) -> int:
        if self.max_host_threads is not None:
            return self.max_host_threads
        return usable_cpus()

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample one setting; returns validated ZenFlowConfig field values."""
        topk = trial.suggest_float("topk_ratio", self.topk_min, self.topk_max, log=True)
        ui = trial.suggest_int("update_interval", 1, self.update_interval_max, log=True)
        windows = trial.suggest_int("select_windows", self.select_windows_min,
                                    self.select_windows_max, log=True)
        chunk_log2 = trial.suggest_int("chunk_log2", self.chunk_log2_min, self.chunk_log2_max)
        threads = trial.suggest_int("host_threads", 1, self.host_threads_max)
        if self.search_host_lr:
            rule = trial.suggest_categorical("host_lr_rule", HOST_LR_RULES)
            if rule == "adaptive":
                host_lr_scale: float | str = "adaptive"
            else:
                host_lr_scale = float(ui) ** trial.suggest_float("host_lr_exponent", 0.0, 1.0)
        else:
            host_lr_scale = ZenFlowConfig().host_lr_scale
        extra: dict[str, Any] = {}
        if self.searches_apply_delay and ui > 1:
            share = trial.suggest_categorical("apply_delay_share", self.apply_delays)
            extra["apply_delay"] = apply_delay_for(share, ui)
        if self.searches_host_betas and ui > 1:
            extra["host_betas"] = trial.suggest_categorical("host_betas", self.host_betas)
        elif self.host_betas is not None:
            extra["host_betas"] = self.host_betas[0]
        return self.settings_from(topk_ratio=topk, update_interval=ui,
                                  select_interval=windows * ui, chunk_size=2 ** chunk_log2,
                                  host_threads=threads, host_lr_scale=host_lr_scale, **extra)

    def settings_from(self, **fields: Any) -> dict[str, Any]:
        fields.setdefault("overlap", self.overlap)
        if self.dense_params is not None:
            fields.setdefault("dense_params", tuple(self.dense_params))
        cfg = ZenFlowConfig(**fields)  # raises ConfigError if anything is out of range
        return {k: getattr(cfg, k) for k in fields}

    def defaults_params(self) -> dict[str, Any]:
        """Optuna params of the library defaults (the first trial of a new study), clipped
        into this space."""
        d = ZenFlowConfig()
        clip = lambda v, lo, hi: min(max(v, lo), hi)  # noqa: E731
        ui = clip(d.update_interval, 1, self.update_interval_max)
        p = {
            "topk_ratio": clip(d.topk_ratio, self.topk_min, self.topk_max),
            "update_interval": ui,
            "select_windows": clip(d.effective_select_interval // d.update_interval,
                                   self.select_windows_min, self.select_windows_max),
            "chunk_log2": clip(d.chunk_size.bit_length() - 1, self.chunk_log2_min,
                               self.chunk_log2_max),
            "host_threads": self.host_threads_max,
        }
        if self.search_host_lr and d.host_lr_scale == "adaptive":
            p["host_lr_rule"] = "adaptive"
        elif self.search_host_lr:
            # host_lr_scale = ui ** e: the default's multiplier of a full window at this ui
            # (for "sqrt": e = 0.5 up to its cap)
            e = math.log(fixed_multiplier(d.host_lr_scale, ui)) / math.log(ui) if ui > 1 else 0.0
            p["host_lr_rule"] = "power"
            p["host_lr_exponent"] = clip(e, 0.0, 1.0)
        if self.searches_apply_delay and ui > 1:
            # the default schedule (share 1.0); a space without it: its longest delay
            p["apply_delay_share"] = max(self.apply_delays)
        if self.searches_host_betas and ui > 1:
            # the library's default where searched, else the first value given
            p["host_betas"] = d.host_betas if d.host_betas in self.host_betas \
                else self.host_betas[0]
        return p

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
