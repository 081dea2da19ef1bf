"""What a saved modelled profile records: its provenance (how the settings were chosen, where
the quality verdict came from), the profile itself, and the name it is saved under."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any

from zenflow_triton.profiles import Profile, validate_name

from .. import stepmodel as M
from ..detect import versions
from ..names import slug
from ..realquality import bar_limits
from ..space import delay_steps
from .grid import ModelledError
from .outcome import ModelledOutcome


def modelled_provenance(out: ModelledOutcome) -> dict[str, Any]:
    """What a modelled profile records about how its settings were chosen."""
    best = out.best
    if best is None:
        raise ModelledError("no feasible grid point fits: nothing to record")
    hw, wl, store = out.hardware, out.workload, out.store
    rate, how = hw.host_rate_and_source(out.gpus)
    measured_rate = bool(hw.host_adam_elements_per_s)
    zo_t = out.zero_offload.modelled_step_time_s
    p = best.prediction
    doc = {
        "source": "modelled",
        "measured": False,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware_profile": out.hardware_profile.name,
        "model": wl.name,
        "gpus": out.gpus,
        "tokens": wl.tokens,
        "mfu": wl.mfu,
        "dtype": wl.dtype,
        "sharding": out.sharding,
        "host_adam_elements_per_s_per_gpu": rate,
        "host_adam_source": (how if measured_rate else
                             f"the profile has no host_adam_elements_per_s (null): the step "
                             f"model's documented default was used ({how}; "
                             "docs/stepmodel.md, Constants)"),
        "objective": {
            "tokens_per_s_per_gpu": best.throughput,
            "step_time_s": p.modelled_step_time_s,
            "micro_batch_tokens": p.micro_batch_tokens,
            "micro_batches": p.micro_batches,
            "loss": wl.loss,
            "stall_fraction": p.stall_fraction,
            "host_busy_fraction": p.host_busy_fraction,
            "device_memory_gb": round(p.device_memory_bytes / 1e9, 2),
            "zero_offload_step_time_s": zo_t,
            "speedup_vs_zero_offload": zo_t / p.modelled_step_time_s,
        },
        "grid": {
            "topk_ratios": sorted({r.point.settings["topk_ratio"] for r in out.rows}),
            "update_intervals": sorted({r.point.settings["update_interval"] for r in out.rows}),
            "apply_delays": sorted({delay_steps(r.point.settings) for r in out.rows}),
            "host_betas": sorted({r.point.settings.get("host_betas", "step") for r in out.rows}),
            "points": len(out.rows),
            "feasible": sum(r.point.feasible for r in out.rows),
            "fit": sum(r.fits for r in out.rows),
        },
        "peers": {m: {"step_time_s": pr.modelled_step_time_s if pr.fits else None,
                      "fits": pr.fits,
                      "device_memory_gb": round(pr.device_memory_bytes / 1e9, 2),
                      "host_memory_gb": round(pr.host_memory_bytes / 1e9, 2)}
                  for m, pr in out.peers.items()},
        "versions": versions(),
    }
    if store.real is None:  # the quality study's verdict, where it always was
        ref = store.reference
        doc["objective"].update(heldout_loss=best.point.heldout_loss, loss_limit=store.limit,
                                adamw_heldout_loss=ref.get("heldout_loss"),
                                initial_heldout_loss=ref.get("initial_loss"))
        doc["grid"]["quality_trial"] = best.point.trial
    doc.update(_quality_provenance(out))
    return doc


def _quality_provenance(out: ModelledOutcome) -> dict[str, Any]:
    """Where a modelled profile's quality verdict came from: the real-model store (the
    models, workloads, seeds and the chosen setting's result on each) or the quality study
    on a workload (its objective and held-out losses)."""
    store, best = out.store, out.best
    if store.real is not None:
        rs, v = store.real.store, best.point.verdict
        return {
            "quality": {
                "source": "real models",
                "summary": f"{v.summary()} (bar {store.real.bar!r}): "
                           + "; ".join(r.describe() for r in v.results),
                "bar": store.real.bar,
                "limits": json.loads(json.dumps(bar_limits(store.real.bar))),
                "setting_class": v.name,
                "trains": {f"on a {kind} gradient": name for kind, name in v.trains.items()},
                "models": sorted({rs.workloads[r.workload]["model"] for r in v.results}),
                "seeds": sorted({seed for r in v.results for seed in r.seeds}),
                "workloads": {r.workload: {"seeds": list(r.seeds),
                                           "loss_delta": r.loss_delta,
                                           "accuracy_delta_pts": r.accuracy_delta_pts,
                                           "task": rs.workloads[r.workload]["task"],
                                           "model": rs.workloads[r.workload]["model"]}
                              for r in v.results},
                "store": {k: rs.provenance.get(k) for k in ("date", "commit", "command")},
            },
            "note": ("Settings chosen by zenflow-tune's modelled objective: the fastest "
                     "setting by the step-time model (autotune/stepmodel; a prediction, not a "
                     "measurement on this hardware) among those that fit in device memory and "
                     "stayed within the quality bar of AdamW on every real-model fine-tune "
                     "of the shipped store (autotune/data/real_quality.json, "
                     "bench/convergence/). Run `zenflow-tune run` on the machine for "
                     "measured settings."),
        }
    ref = store.reference
    return {
        "quality_study": store.study_name,
        "quality_storage": store.storage,
        "workload": store.settings.workload,
        "loss_margin": store.settings.loss_margin,
        "tune_settings": store.settings.to_dict(),
        "quality": {"source": f"the workload {store.settings.workload!r}",
                    "summary": f"held-out loss {best.point.heldout_loss:.4f} within the limit "
                               f"{store.limit:.4f} (AdamW {ref.get('heldout_loss', math.nan):.4f}"
                               f", margin {store.settings.loss_margin:g})"},
        "note": ("Settings chosen by zenflow-tune's modelled objective: the fastest grid "
                 "point by the step-time model (autotune/stepmodel; a prediction, not a "
                 "measurement on this hardware) among those whose held-out loss on the "
                 f"workload {store.settings.workload!r} was within loss_margin of AdamW's "
                 "(measured, hardware-independent) and whose state fits in device memory. "
                 "chunk_size and host_threads do not change the result and are not chosen "
                 "here. Run `zenflow-tune run` on the machine for measured settings."),
    }


def modelled_profile(out: ModelledOutcome, name: str) -> Profile:
    """The chosen point as a profile: the hardware profile's facts and other settings, the
    point's quality settings, and the modelled provenance."""
    if out.best is None:
        raise ModelledError("no feasible grid point fits in device memory: no profile to save")
    prof = out.hardware_profile
    return Profile(name=validate_name(name), settings=dict(out.best.settings),
                   hardware=dict(prof.hardware), provenance=modelled_provenance(out),
                   description=f"{prof.description or prof.name}; settings modelled for "
                               f"{out.workload.name} on {out.gpus} GPU(s)",
                   source="memory")


def default_save_name(profile: str, model: str, gpus: int, tokens: int | None) -> str:
    """The profile a modelled run saves by default: ``<profile>-<model>``, with the GPUs and
    tokens when not the defaults (a built-in is not shadowed by accident). A model given as
    a path to a config.json is named by its folder, a ``module:function`` by the function."""
    if model.endswith(".json") or os.path.sep in model:
        path = Path(model)
        model = (path.parent if path.suffix == ".json" else path).name or "model"
    elif ":" in model:
        model = model.rpartition(":")[2]
    name = f"{profile}-{model}"
    if gpus != 1:
        name += f"-{gpus}gpu"
    if tokens and tokens != M.DEFAULT_TOKENS:
        name += f"-{tokens}tok"
    return slug(name, 64)
