"""Quality from real models: the convergence study's verdicts, shipped with the package.

The tuner's speed comes from the step model; whether a setting keeps a fine-tune at AdamW's
quality comes from here by default: real pretrained models (SmolLM2-135M, all-MiniLM-L6-v2
and a 3-layer cut of it) fine-tuned on real text (Python's docs, BBC News, Rotten Tomatoes,
crowd-labelled tweets), each setting against ``torch.optim.AdamW`` on the same seeds
(``bench/convergence/study.py``). ``bench/convergence/quality_store.py`` distils the study's
rows into ``autotune/data/real_quality.json``: per setting class (the settings that change
the arithmetic, :data:`QUALITY_KEYS`) and per workload, the mean over seeds of the final
held-out loss minus AdamW's and (classifiers) the accuracy minus AdamW's, with provenance
(the study files, the commits that wrote them, the command, the seeds, the date).

A setting **passes** when every workload it was measured on is within the bar
(:data:`BARS`) and it was measured, at 2 seeds or more, on every *core* workload of the
store. A setting the store has not measured is *unmeasured*: the tuner says so and leaves
it out; nothing is interpolated.

A setting with ``fresh_if_spread`` on trains two schedules: as given on a concentrated
gradient, and freshened (``host_betas="window"``, ``apply_delay=1``, the rest alike) on a
spread one. It passes only where both were measured and passed (and its own rows, where the
store has some, passed too): :meth:`RealStore.verdict`. The study's rows ran with it off
unless their setting says so, and are keyed so.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["QUALITY_KEYS", "OTHER_ARITHMETIC", "KEY_LEFT_OUT", "BARS", "DEFAULT_BAR",
           "STORE_PATH", "RealStoreError", "RealStore", "Verdict", "WorkloadResult",
           "setting_key", "switched", "load_store"]

QUALITY_KEYS = ("topk_ratio", "update_interval", "select_interval", "host_lr_scale", "overlap",
                "dense_params", "apply_delay", "accumulator_dtype", "host_betas")
"""The settings that change the optimizer's arithmetic and that the tuner searches (a grid
point). In a quality study's point key (``modelled.point_key``) an ``apply_delay`` of None
(the default schedule), an ``accumulator_dtype`` of "float32" and a ``host_betas`` of "step"
are left out (:data:`KEY_LEFT_OUT`), so points stored before those were searched keep
theirs."""
OTHER_ARITHMETIC = ("host_state_dtype", "warmup_steps", "min_offload_numel", "score",
                   "fresh_if_spread")
"""Settings the tuner does not search that change the arithmetic too: part of a real-model
setting's key (:func:`setting_key`), so a profile that sets them is not judged by rows that
ran without them (``fresh_if_spread``: switching the schedule on a spread gradient)."""
KEY_LEFT_OUT = {"apply_delay": None, "accumulator_dtype": "float32", "host_betas": "step"}
"""Values of :data:`QUALITY_KEYS` that a point's key leaves out (those settings' values
before they were keys)."""

BARS: dict[str, dict[str, dict[str, float]]] = {
    "tuned": {"classification": {"loss": 0.02, "accuracy_pts": -1.5}, "lm": {"loss": 0.015}},
    "default": {"classification": {"loss": 0.01, "accuracy_pts": -0.5}, "lm": {"loss": 0.005}},
}
"""How far from AdamW (mean over seeds, same seeds) a setting may end on a workload: held-out
loss (nats) at most ``loss`` above AdamW's and (classifiers) accuracy at most
``accuracy_pts`` points below. ``"default"``: the goals the library's defaults are held to
(issue 50); ``"tuned"``: what a setting chosen for speed may cost (the goals of ``0.02 x
8``, docs/quality.md). The tuner uses ``"tuned"`` unless told otherwise."""
DEFAULT_BAR = "tuned"
STORE_PATH = Path(__file__).resolve().parent / "data" / "real_quality.json"
FORMAT = 2
"""2: every entry's settings name ``fresh_if_spread`` as its rows ran (1 left it out, and
its rows ran with it off)."""
MIN_SEEDS = 2


class RealStoreError(ValueError):
    """The real-model store is missing, corrupt, or asked for an unknown bar."""


def switched(settings: dict[str, Any]) -> dict[str, Any] | None:
    """The settings a spread gradient switches ``settings`` to (``fresh_if_spread`` on a
    stale default: ``host_betas="window"``, ``apply_delay=1``, the rest alike), or None
    where nothing switches."""
    from zenflow_triton.columns.spread import freshened
    from zenflow_triton.config import ZenFlowConfig

    keys = QUALITY_KEYS + OTHER_ARITHMETIC
    if freshened(ZenFlowConfig(**{k: v for k, v in settings.items() if k in keys})) is None:
        return None
    return dict(settings, host_betas="window", apply_delay=1, fresh_if_spread=False)


def setting_key(settings: dict[str, Any]) -> str:
    """The identity of a setting class: its :data:`QUALITY_KEYS` and :data:`OTHER_ARITHMETIC`
    as ``ZenFlowConfig`` resolves them (defaults filled in, numbers as floats, the select
    interval and apply delay in steps, the apply delay None without overlap; the dense set as
    ``"dense"`` when it is the library's, ``"none"`` when empty; what a window of one gradient
    makes moot, None; ``fresh_if_spread`` True only where it may switch the schedule:
    :func:`~zenflow_triton.columns.spread.freshened`), as JSON. Two settings with the same key
    train the same arithmetic on fp32 models (where the window is summed, or whether the
    gradient streams, does not change it)."""
    from zenflow_triton.columns.spread import freshened
    from zenflow_triton.config import ZenFlowConfig

    keys = QUALITY_KEYS + OTHER_ARITHMETIC
    cfg = ZenFlowConfig(**{k: v for k, v in settings.items() if k in keys})
    default_dense = sorted(ZenFlowConfig().dense_params)
    dense = sorted(cfg.dense_params)
    key = {k: getattr(cfg, k) for k in keys}
    for k, v in key.items():  # 1 and 1.0 are one setting
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            key[k] = float(v)
    key["dense_params"] = "dense" if dense == default_dense else "none" if not dense else dense
    key["apply_delay"] = float(cfg.effective_apply_delay) if cfg.overlap else None
    key["select_interval"] = float(cfg.effective_select_interval)
    key["fresh_if_spread"] = freshened(cfg) is not None
    if cfg.update_interval == 1:  # a window of one gradient: one computation whatever these say
        for k in ("host_betas", "host_lr_scale", "accumulator_dtype", "apply_delay"):
            key[k] = None
    return json.dumps(key, sort_keys=True)


@dataclass(frozen=True)
class WorkloadResult:
    workload: str
    kind: str            # "classification" or "lm"
    seeds: tuple[int, ...]
    loss_delta: float    # mean held-out loss minus AdamW's (nats)
    accuracy_delta_pts: float | None
    passed: bool
    why: str = ""        # what missed the bar, when it failed

    def describe(self) -> str:
        acc = (f", {self.accuracy_delta_pts:+.1f} pts" if self.accuracy_delta_pts is not None
               else "")
        return f"{self.workload} {self.loss_delta:+.4f}{acc}"


@dataclass(frozen=True)
class Verdict:
    """A setting's verdict on the store: ``measured`` (at :data:`MIN_SEEDS` seeds on every
    core workload), ``passed`` (measured and within the bar everywhere it was measured).
    For a setting that switches on a spread gradient (:func:`switched`), ``name``,
    ``results`` and ``missing`` are its schedule's as given, :attr:`spread` the verdict of
    the one it switches to, :attr:`own` that of its own rows (where the store has some);
    ``measured`` and ``passed`` are of all of them."""
    key: str
    name: str | None                     # the study's name for the setting class
    measured: bool
    passed: bool
    results: tuple[WorkloadResult, ...] = ()
    missing: tuple[str, ...] = ()        # core workloads without MIN_SEEDS seeds
    spread: "Verdict | None" = None      # the schedule a spread gradient switches it to
    own: "Verdict | None" = None         # its own rows, switching as they ran

    def _all(self) -> tuple[WorkloadResult, ...]:
        return self.results + sum((v.results for v in (self.spread, self.own) if v), ())

    @property
    def failed(self) -> tuple[WorkloadResult, ...]:
        return tuple(r for r in self._all() if not r.passed)

    @property
    def worst_loss_delta(self) -> float | None:
        return max((r.loss_delta for r in self._all()), default=None)

    @property
    def worst_accuracy_delta(self) -> float | None:
        accs = [r.accuracy_delta_pts for r in self._all() if r.accuracy_delta_pts is not None]
        return min(accs, default=None)

    @property
    def trains(self) -> dict[str, str | None]:
        """The setting class it trains on each kind of gradient (the study's names)."""
        return {"concentrated": self.name,
                "spread": self.name if self.spread is None else self.spread.name}

    def summary(self) -> str:
        text = self._summary()
        if self.spread is not None:
            other = self.spread.name or "a class the store lacks"
            text += (f"; on a spread gradient it trains as {other} (fresh_if_spread): "
                     f"{self.spread._summary()}")
        if self.own is not None and self.own.failed:
            text += "; its own rows failed on " + "; ".join(r.describe() for r in self.own.failed)
        return text

    def _summary(self) -> str:
        """This schedule's own part (``measured`` is ``not missing`` for one schedule)."""
        if self.missing:
            return f"not measured on real models (missing: {', '.join(self.missing)})"
        if all(r.passed for r in self.results):
            return f"passed on {len(self.results)} real-model workloads"
        return "failed on " + "; ".join(r.describe() for r in self.results if not r.passed)


@dataclass
class RealStore:
    """The shipped store (:data:`STORE_PATH`), read and checked."""
    path: Path
    provenance: dict[str, Any]
    workloads: dict[str, dict[str, Any]]
    core: tuple[str, ...]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """setting key -> {"name", "settings", "results": {workload: {...}}}"""

    def verdict(self, settings: dict[str, Any], bar: str = DEFAULT_BAR) -> Verdict:
        """``settings``' verdict by ``bar``; one that switches on a spread gradient
        (:func:`switched`) passes only where its schedule as given and the one it switches
        to both passed (and its own rows, if any, failed nowhere)."""
        fresh = switched(settings)
        if fresh is None:
            return self._verdict(settings, bar)
        given = self._verdict(dict(settings, fresh_if_spread=False), bar)
        spread = self._verdict(fresh, bar)
        own = self._verdict(settings, bar)
        own = own if own.name is not None else None
        measured = given.measured and spread.measured
        return dataclasses.replace(
            given, key=setting_key(settings), measured=measured, spread=spread, own=own,
            passed=measured and given.passed and spread.passed and not (own and own.failed))

    def _verdict(self, settings: dict[str, Any], bar: str) -> Verdict:
        limits = bar_limits(bar)
        key = setting_key(settings)
        entry = self.entries.get(key)
        if entry is None:
            return Verdict(key=key, name=None, measured=False, passed=False,
                           missing=self.core)
        results = []
        for wl, r in sorted(entry["results"].items()):
            kind = self.workloads[wl]["kind"]
            results.append(_judge(wl, kind, r, limits[kind]))
        have = {r.workload for r in results if len(r.seeds) >= MIN_SEEDS}
        missing = tuple(w for w in self.core if w not in have)
        measured = not missing
        return Verdict(key=key, name=entry.get("name"), measured=measured,
                       passed=measured and all(r.passed for r in results),
                       results=tuple(results), missing=missing)

    def describe(self) -> str:
        """One line: what the store holds and where it came from."""
        models = sorted({w["model"] for w in self.workloads.values()})
        seeds = self.provenance.get("seeds", [])
        return (f"real-model store {self.path.name} ({len(self.entries)} setting classes; "
                f"core workloads {', '.join(self.core)}; models {', '.join(models)}; seeds "
                f"{', '.join(map(str, seeds))}; built {self.provenance.get('date', '?')} "
                f"at {str(self.provenance.get('commit', '?'))[:10]})")


def bar_limits(bar: str) -> dict[str, dict[str, float]]:
    try:
        return BARS[bar]
    except KeyError:
        raise RealStoreError(f"unknown quality bar {bar!r}; bars: {', '.join(BARS)}") from None


def _judge(wl: str, kind: str, r: dict[str, Any], limit: dict[str, float]) -> WorkloadResult:
    if r.get("diverged"):
        return WorkloadResult(workload=wl, kind=kind, seeds=tuple(int(s) for s in r["seeds"]),
                              loss_delta=math.inf, accuracy_delta_pts=None, passed=False,
                              why=f"diverged on {r['diverged']} seed(s)")
    loss = float(r["loss_delta"])
    acc = r.get("accuracy_delta_pts")
    why = []
    if loss > limit["loss"]:
        why.append(f"loss {loss:+.4f} > +{limit['loss']:g}")
    if acc is not None and "accuracy_pts" in limit and acc < limit["accuracy_pts"]:
        why.append(f"accuracy {acc:+.1f} pts < {limit['accuracy_pts']:g}")
    return WorkloadResult(workload=wl, kind=kind, seeds=tuple(int(s) for s in r["seeds"]),
                          loss_delta=loss,
                          accuracy_delta_pts=None if acc is None else float(acc),
                          passed=not why, why="; ".join(why))


def _number(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RealStoreError(f"{where} must be a finite number, got {value!r}")


def load_store(path: str | Path | None = None) -> RealStore:
    """The store at ``path`` (default: the shipped one), checked: a missing file, bad JSON, a
    wrong format or an entry naming an unknown workload raise :class:`RealStoreError` naming
    the file and the problem."""
    p = Path(path) if path is not None else STORE_PATH
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RealStoreError(f"real-model quality store {p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RealStoreError(f"real-model quality store {p}: not readable JSON ({e})") from None
    try:
        if doc.get("format") != FORMAT:
            raise RealStoreError(f"format {doc.get('format')!r}, expected {FORMAT}")
        workloads = dict(doc["workloads"])
        for name, w in workloads.items():
            if w.get("kind") not in ("classification", "lm"):
                raise RealStoreError(f"workload {name!r}: kind {w.get('kind')!r}")
        core = tuple(doc["core"])
        if not set(core) <= workloads.keys():
            raise RealStoreError(f"core workloads {sorted(set(core) - workloads.keys())} "
                                 "are not described")
        for name, w in workloads.items():
            if not isinstance(w.get("model"), str) or not isinstance(w.get("task"), str):
                raise RealStoreError(f"workload {name!r}: needs a model and a task")
        entries = {}
        for e in doc["entries"]:
            key = setting_key(e["settings"])
            if key in entries:
                raise RealStoreError(f"entries {entries[key].get('name')!r} and "
                                     f"{e.get('name')!r} are one setting")
            for wl, r in e["results"].items():
                if wl not in workloads:
                    raise RealStoreError(f"entry {e.get('name')!r}: unknown workload {wl!r}")
                if not r.get("diverged"):
                    _number(f"entry {e.get('name')!r}, {wl}: loss_delta", r["loss_delta"])
                if r.get("accuracy_delta_pts") is not None:
                    _number(f"entry {e.get('name')!r}, {wl}: accuracy_delta_pts",
                            r["accuracy_delta_pts"])
                if not r["seeds"] or not all(isinstance(x, int) for x in r["seeds"]):
                    raise RealStoreError(f"entry {e.get('name')!r}, {wl}: seeds "
                                         f"{r['seeds']!r}")
            entries[key] = e
    except RealStoreError as e:
        raise RealStoreError(f"real-model quality store {p}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RealStoreError(f"real-model quality store {p}: malformed ({type(e).__name__}: "
                             f"{e})") from None
    return RealStore(path=p, provenance=dict(doc.get("provenance", {})), workloads=workloads,
                     core=core, entries=entries)
