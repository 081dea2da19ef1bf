"""A modelled run as text: the final table, the peers beside the pick, the guard line."""

from __future__ import annotations

import math
from typing import Any

from ..objective import guard_summary
from ..realquality import bar_limits
from ..space import delay_steps
from .grid import QualityStore
from .outcome import PEER_SOFTWARE, SPEED_TOLERANCE, ModelledOutcome


# ---- reporting ---------------------------------------------------------------------------------
def format_modelled_table(out: ModelledOutcome, top: int = 5) -> str:
    """The final table of a modelled run (like the measured run's): the best eligible rows,
    then the peers beside the pick (:func:`peer_lines`) and what the grid held."""
    store, wl = out.store, out.workload
    zo_t = out.zero_offload.modelled_step_time_s
    real = store.real is not None
    lines = _ranked_rows(out, top)
    if real:
        lines.append("dloss: the worst held-out loss minus AdamW's over the store's workloads "
                     "(nats, mean of seeds); dacc: the worst accuracy minus AdamW's (points)")
    lines.append(f"modelled zero-offload: {wl.tokens / zo_t:,.0f} tokens/s per GPU "
                 f"({zo_t:.3f} s/step); model {wl.name}, {out.gpus} GPU(s) ({out.sharding}), "
                 f"{wl.tokens} tokens/GPU/step on {out.hardware.name}")
    top_speed = out.eligible[0] if out.eligible else None
    if out.best is not None and out.best is not top_speed:
        lines.append(f"the pick is within {SPEED_TOLERANCE:.0%} of the fastest eligible setting "
                     f"({top_speed.throughput:,.0f} tokens/s) with a shorter window or more "
                     "columns on the device: where speed is free, the fresher setting")
    faster = [r for r in out.rows if r.fits and not r.point.feasible
              and (out.best is None or r.throughput > out.best.throughput)]
    if faster:
        f = faster[0]
        why = (f.point.verdict.summary() if real else "diverged"
               if f.point.heldout_loss is None
               else f"loss {f.point.heldout_loss:.4f} > {store.limit:.4f}")
        lines.append(f"fastest point overall: topk {f.point.settings['topk_ratio']:g}, "
                     f"interval {f.point.settings['update_interval']}, "
                     f"{f.throughput:,.0f} tokens/s, infeasible ({why})")
    lines += peer_lines(out)
    lines += _searched(out)
    lines += [f"note: {n}" for n in out.notes]
    return "\n".join(lines)


def _ranked_rows(out: ModelledOutcome, top: int) -> list[str]:
    """The table's head and its ``top`` best eligible rows."""
    store = out.store
    zo_t = out.zero_offload.modelled_step_time_s
    real = store.real is not None
    # a betas column where the grid searched host_betas
    betas = any(r.point.settings.get("host_betas", "step") != "step" for r in out.rows)
    quality = (f"{'dloss':>8} {'dacc':>6}" if real else f"{'loss':>7} {'limit':>7}")
    head = (f"{'rank':>4} {'tokens/s':>10} {'vs zero-off':>11} {'step s':>7} {'stall':>6} "
            f"{quality} {'topk':>6} {'upd':>4} {'sel':>5} {'delay':>5} "
            + (f"{'betas':<6} " if betas else "") + f"{'memory side':<14}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(out.eligible[:top], 1):
        s = r.point.settings
        if real:
            acc = r.point.verdict.worst_accuracy_delta
            q = f"{r.point.heldout_loss:>+8.4f} {'-' if acc is None else format(acc, '+.1f'):>6}"
        else:
            q = f"{r.point.heldout_loss:>7.4f} {store.limit:>7.4f}"
        lines.append(
            f"{i:>4} {r.throughput:>10,.0f} {zo_t / r.step_time_s:>10.2f}x "
            f"{r.step_time_s:>7.3f} {r.prediction.stall_fraction:>6.0%} {q} "
            f"{s['topk_ratio']:>6.3g} {s['update_interval']:>4} {s['select_interval']:>5} "
            f"{delay_steps(s):>5} " + (f"{s.get('host_betas', 'step'):<6} " if betas else "")
            + f"{memory_side(r.settings):<14}")
    if not out.eligible:
        lines.append("  (no feasible point fits)")
    return lines


def _searched(out: ModelledOutcome) -> list[str]:
    """What the search held: the points, how many passed the guard and fit, and where their
    quality came from."""
    store = out.store
    real = store.real is not None
    lines = []
    n = len(out.rows)
    nf = sum(r.point.feasible for r in out.rows)
    fit = sum(r.fits for r in out.rows)
    if real:
        rs = store.real
        lines.append(f"quality: {rs.store.describe()}; bar {rs.bar!r} "
                     f"({_bar_text(rs.bar)}); {n} measured setting(s), {nf} within it, "
                     f"{fit} fit in memory (device and host)"
                     + (f"; {len(rs.unmeasured)} asked for but not measured: left out"
                        if rs.unmeasured else ""))
        if out.best is not None:
            lines.append(f"the pick ({out.best.point.verdict.name}): "
                         + "; ".join(r.describe() for r in out.best.point.verdict.results))
    else:
        ref = store.reference
        lines.append(f"grid: {n} points, {nf} feasible, {n - nf} infeasible, {fit} fit in "
                     f"device memory; quality study {store.study_name!r} ({store.trials_run} "
                     f"run(s) trained now), AdamW held-out loss "
                     f"{ref.get('heldout_loss', math.nan):.4f} (from "
                     f"{ref.get('initial_loss') or math.nan:.4f})")
    return lines


def _bar_text(bar: str) -> str:
    lim = bar_limits(bar)
    c, lm = lim["classification"], lim["lm"]
    return (f"classifiers within +{c['loss']:g} nats and {c['accuracy_pts']:g} points of AdamW, "
            f"LMs within +{lm['loss']:g} nats")


def peer_lines(out: ModelledOutcome) -> list[str]:
    """The pick beside every peer mode the step model has for this model and card, with
    device and host memory; where a peer that fits is faster, said plainly and by how much."""
    rows = []
    if out.best is not None:
        p = out.best.prediction
        rows.append(("zenflow (the pick)", p.modelled_step_time_s, p))
    for mode, p in out.peers.items():
        rows.append((mode, p.modelled_step_time_s if p.fits else None, p))
    if not rows:
        return []
    lines = ["beside the peers (modelled, the same model and card):",
             f"  {'mode':<20} {'step s':>8} {'device GB':>10} {'host GB':>8}"]
    for name, t, p in rows:
        lines.append(f"  {name:<20} {'no fit' if t is None else format(t, '.3f'):>8} "
                     f"{p.device_memory_bytes / 1e9:>10.1f} {p.host_memory_bytes / 1e9:>8.1f}")
    fastest = fastest_peer(out)
    if out.best is None:
        if fastest is not None:
            v, m = fastest
            lines.append(f"no ZenFlow setting qualifies here: use {m} ({v:.3f} s/step, "
                         f"the fastest peer that fits): {PEER_SOFTWARE.get(m, m)}")
        return lines
    t = out.best.step_time_s
    if fastest is not None and fastest[0] < t:
        v, m = fastest
        lines.append(f"{m} is faster than the pick by {t / v - 1:.0%} ({v:.3f} s against "
                     f"{t:.3f} s per step, modelled): prefer it on this card")
    elif fastest is not None:
        v, m = fastest
        lines.append(f"the pick is the fastest: {v / t:.2f}x the next, {m} ({v:.3f} s/step)")
    return lines


def fastest_peer(out: ModelledOutcome) -> tuple[float, str] | None:
    """``(step seconds, mode)`` of the fastest peer mode that fits, or None."""
    return min(((p.modelled_step_time_s, m) for m, p in out.peers.items() if p.fits),
               default=None)


def device_side(settings: dict[str, Any]) -> str:
    """What of a row's settings decides its device memory: the dense set kept (``dense``) or
    not (``lean``), the window summed on the ``host`` or device, in bf16 or fp32, and the
    gradient streamed off the device during backward (``stream``)."""
    dense = "lean" if settings.get("dense_params") == () else "dense"
    stream = " stream" if settings.get("stream_grads") else ""
    if settings.get("update_interval", 2) <= 1:
        return dense + stream  # no window to sum
    acc = "bf16" if settings.get("accumulator_dtype") == "bfloat16" else "fp32"
    where = "host" if settings.get("accumulate_on") == "host" else "dev"
    return f"{dense} {where}-{acc}{stream}"


def memory_side(settings: dict[str, Any]) -> str:
    """:func:`device_side`, and ``bf16-moments`` where the host moments are bf16 (what the
    host's memory needs)."""
    moments = " bf16-moments" if settings.get("host_state_dtype") == "bfloat16" else ""
    return device_side(settings) + moments


def guard_line(store: QualityStore) -> str:
    """The guard line (and warning) of the measured objective, for this store; for the
    real-model store, what it is."""
    if store.real is not None:
        return (f"quality guard: the real-model store, bar {store.real.bar!r} "
                f"({_bar_text(store.real.bar)}, on every workload, mean of seeds)")
    return guard_summary(store.reference, store.settings.loss_margin)
