"""Regenerate the built-in GPU profiles' settings with the modelled objective.

For every built-in profile with accelerator facts (all but ``cpu``) this picks, from the
setting classes of the real-model quality store (``autotune/data/real_quality.json``: real
pretrained models fine-tuned against AdamW, 2 seeds; ``--quality workload``: the quality grid
of ``autotune/modelled/`` trained on the embedded CPU workload instead), the fastest
point within the quality bar by the step-time
model for ``--model`` (default ``llama2-7b``) on 1 GPU with 4096 tokens per step, and writes
it into ``zenflow_triton/profiles/builtin/<name>.json``: ``settings`` (the quality settings;
the others are kept) and ``provenance`` (``"source": "modelled"``, the model, GPUs, tokens,
quality study, workload, loss margin, date, modelled step time and stall; the citations are
kept). The hardware facts are not touched.

If no grid point of ``--model`` fits a profile's device memory (params and gradients alone
of a 7B model in bf16 are 27 GB: more than an RTX 4090's 24 GB), the next preset of
``--fallback`` that fits is used, and the provenance says so.

``cpu`` is not regenerated: it has no accelerator facts for the step-time model to use, and
on a CPU-only machine the device and the host are the same memory, so only a measurement
(``zenflow-tune run --profile cpu``) can choose its settings; it keeps the paper defaults.

    python bench/regenerate_profiles.py                 # train missing grid points, write
    python bench/regenerate_profiles.py --dry-run       # print the choices, write nothing
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import modelled as MD  # noqa: E402
from autotune.realquality import BARS  # noqa: E402
from autotune import stepmodel as SM  # noqa: E402
from zenflow_triton.profiles import Profile, builtin_profile_dir  # noqa: E402

SKIP = ("cpu",)


def _why_none(hw, rows) -> str:
    """Why no point of ``rows`` was chosen: none fits the device, none of those that do fits
    the host, or none passed the quality bar."""
    usable = hw.usable_device_bytes or 0
    on_device = [r.prediction for r in rows if r.prediction.device_memory_bytes <= usable]
    if not on_device:
        need = min(r.prediction.device_memory_bytes for r in rows) / 1e9
        return (f"does not fit: at least {need:.1f} GB of device memory (activations "
                f"included) against {hw.device_memory_bytes / 1e9:.0f} GB")
    if not any(p.fits for p in on_device):
        need = min(p.host_memory_bytes for p in on_device) / 1e9
        return (f"does not fit the host: at least {need:.1f} GB of host memory against "
                f"{hw.host_memory_bytes / 1e9:.0f} GB ({hw.usable_host_bytes / 1e9:.1f} usable)")
    return "no point that fits passes the quality bar"


def regenerate(names: list[str] | None, model: str, fallback: list[str], gpus: int,
               tokens: int, storage: str | None, dry_run: bool, top: int,
               headroom: float = 0.25, apply_delays: tuple[float, ...] | None = None,
               quality: str = "real", bar: str = MD.DEFAULT_BAR) -> int:
    if quality == "real":  # every setting class the real-model store measured, by its bar
        store = MD.real_quality_store(None, bar)
        ceiling = ref = math.inf
        print(MD.guard_line(store))
    else:
        factory, ts = MD.default_quality_settings()
        grid = MD.QualityGrid(apply_delays=apply_delays) if apply_delays else None
        store = MD.run_quality_grid(factory=factory, ts=ts, storage_url=storage, grid=grid,
                                    log=lambda m: print(m, flush=True))
        print()
        print(MD.guard_line(store))
        ref = float(store.reference["heldout_loss"])
        # A point chosen for a built-in profile keeps this share of the guard's allowance
        # (limit - AdamW's loss): the fastest feasible point can pass by a hair, one seed's
        # noise away from failing.
        ceiling = store.limit - headroom * (store.limit - ref)
        print(f"headroom {headroom:g}: a built-in profile's point needs a held-out loss <= "
              f"{ceiling:.4f} (limit {store.limit:.4f}, AdamW {ref:.4f})")
    paths = sorted(builtin_profile_dir().glob("*.json"))
    chosen = []
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        name = doc["name"]
        if name in SKIP or (names and name not in names):
            continue
        prof = Profile.from_dict(doc, path=path, source="builtin")
        hw = SM.Hardware.from_profile(prof)
        out = None
        tried = []
        for preset in [model] + [f for f in fallback if f != model]:
            wl = SM.Workload.from_preset(preset, tokens=tokens)
            rows = MD.rank_points(store, hw, wl, gpus=gpus, base_settings=dict(prof.settings))
            cfg = SM.zenflow_config(dict(prof.settings))
            zo = SM.predict(hw, wl, "zero-offload", gpus=gpus, config=cfg)
            eligible = [r for r in rows if r.eligible and (store.real is not None
                                                           or r.point.heldout_loss <= ceiling)]
            out = MD.ModelledOutcome(store=store, hardware_profile=prof, hardware=hw,
                                     workload=wl, gpus=gpus, rows=rows,
                                     best=MD.quality_first(eligible), zero_offload=zo,
                                     peers=SM.predict_all(hw, wl, gpus=gpus, config=cfg,
                                                          modes=MD.PEER_MODES))
            if out.best is not None:
                break
            tried.append(f"{preset}: {_why_none(hw, rows)}")
        print(f"\n== {name}: {out.workload.name}, {gpus} GPU(s), {tokens} tokens/GPU/step")
        for t in tried:
            print(f"   ({t})")
        print(MD.format_modelled_table(out, top=top))
        if out.best is None:
            print(f"   no feasible point fits {name}: left unchanged", file=sys.stderr)
            continue
        prov = MD.modelled_provenance(out)
        prov.pop("quality_storage", None)  # a path on the machine that ran it: not portable
        if tried:
            prov["fallback"] = "; ".join(tried) + f"; modelled with {out.workload.name} instead"
        prov["replaces"] = ("paper defaults (topk_ratio=0.1, update_interval=4) of the ZenFlow "
                            "paper, which the citations give")
        prov["regenerate"] = "python bench/regenerate_profiles.py"
        if store.real is None:
            prov["headroom"] = (
                f"chosen among points whose held-out loss leaves {headroom:g} of the guard's "
                f"allowance: {out.best.point.heldout_loss:.4f} <= {ceiling:.4f} (limit "
                f"{store.limit:.4f}, AdamW {ref:.4f}); margin to the limit "
                f"{store.limit - out.best.point.heldout_loss:.4f}")
        prov["citations"] = doc["provenance"].get("citations", [])
        settings = dict(doc["settings"])
        settings.pop("fresh_if_spread", None)  # the point's say (pinned off where its switch
        settings.update(out.best.point.settings)  # on a spread gradient did not pass)
        # what made it fit (rank_points), and the host moments it was measured with
        for key in ("accumulate_on", "stream_grads", "host_state_dtype"):
            if key in out.best.settings:
                settings[key] = out.best.settings[key]
        if out.best.point.settings.get("apply_delay") is None:  # the default: not written
            settings.pop("apply_delay", None)
        new = dict(doc, settings=settings, provenance=prov)
        Profile.from_dict(json.loads(json.dumps(new)), path=path)  # valid before writing
        s = out.best.point.settings
        chosen.append((name, out.workload.name, s["topk_ratio"], s["update_interval"],
                       out.best.throughput, out.best.step_time_s,
                       out.best.prediction.stall_fraction,
                       out.zero_offload.modelled_step_time_s / out.best.step_time_s))
        if not dry_run:
            path.write_text(json.dumps(new, indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
    print("\n| profile | model | topk_ratio | update_interval | tokens/s per GPU | step (s) "
          "| stall | vs zero-offload |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n, m, k, ui, thr, st, stall, zo in chosen:
        print(f"| `{n}` | {m} | {k:g} | {ui} | {thr:,.0f} | {st:.3f} | {stall:.0%} | "
              f"{zo:.2f}x |")
    print("\n(dry run: nothing written)" if dry_run else
          f"\nwrote {len(chosen)} profile(s) in {builtin_profile_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="*", help="only these built-ins (default: all but cpu)")
    ap.add_argument("--model", default="llama2-7b", choices=sorted(SM.PRESETS))
    ap.add_argument("--fallback", default="qwen2.5-3b,opt-350m",
                    help="presets to try, in order, where --model does not fit")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=SM.DEFAULT_TOKENS)
    ap.add_argument("--storage", help="SQLAlchemy URL of the quality study (default: the "
                                      "tuner's default storage)")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--headroom", type=float, default=0.25,
                    help="share of the guard's allowance (limit - AdamW's loss) a chosen "
                         "point must leave unused, in [0, 1) (default 0.25)")
    ap.add_argument("--delay-grid", default=None,
                    help="apply_delay values of the quality grid as fractions of each update "
                         "interval, comma-separated in (0, 1] (default 1: the next boundary)")
    ap.add_argument("--quality", choices=("real", "workload"), default="real",
                    help="real (default): the real-model store, nothing trained; workload: "
                         "the quality grid trained on the embedded tiny LM")
    ap.add_argument("--quality-bar", default=MD.DEFAULT_BAR, choices=sorted(BARS))
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    fallback = [f for f in a.fallback.split(",") if f]
    for f in fallback:
        if f not in SM.PRESETS:
            ap.error(f"--fallback: unknown preset {f!r}; valid: {', '.join(sorted(SM.PRESETS))}")
    if not 0 <= a.headroom < 1:
        ap.error(f"--headroom must be in [0, 1), got {a.headroom}")
    delays = None
    if a.delay_grid:
        try:
            delays = tuple(float(v) for v in a.delay_grid.split(",") if v)
            MD.QualityGrid(apply_delays=delays)
        except (ValueError, MD.ModelledError) as e:
            ap.error(f"--delay-grid: {e}")
    return regenerate(a.profiles, a.model, fallback, a.gpus, a.tokens, a.storage, a.dry_run,
                      a.top, a.headroom, delays, a.quality, a.quality_bar)


if __name__ == "__main__":
    sys.exit(main())
