"""The commands that read what is there: ``zenflow-tune list`` (profiles and stored
studies), ``show`` (a profile, or a study's best trials), ``detect`` (this machine),
``plot`` (a study's PNGs) and ``diagnose`` (gradient concentration of a workload under
AdamW). The library modules are imported by the command that needs them: ``detect`` and
``diagnose`` run without Optuna."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..names import slug
from . import EXIT_OK, UsageError, load_workload, storage_url


def cmd_list(args: argparse.Namespace) -> int:
    from zenflow_triton.profiles import list_profiles, user_profile_dir

    from .. import study as S

    profiles, bad = list_profiles(errors="collect")
    print(f"profiles (user dir: {user_profile_dir()}):")
    print(f"  {'name':<24} {'source':<8} {'provenance':<15} {'topk':>6} {'upd':>4}  device")
    for p in profiles:
        print(f"  {p.name:<24} {p.source:<8} {p.provenance.get('source', '?'):<15} "
              f"{p.settings.get('topk_ratio', float('nan')):>6.3g} "
              f"{p.settings.get('update_interval', '-'):>4}"
              f"  {p.hardware.get('device', '')}")
    for e in bad:
        print(f"  BROKEN: {e}")
    url = storage_url(args)
    if storage_exists(args, url):
        import optuna

        summaries = optuna.study.get_all_study_summaries(S.make_storage(url))
        print(f"\nstudies in {S.redact_url(url)}:")
        if not summaries:
            print("  (none)")
        for s in summaries:
            print(f"  {s.study_name:<32} {s.n_trials:>4} trials  "
                  f"started {s.datetime_start:%Y-%m-%d %H:%M}" if s.datetime_start else
                  f"  {s.study_name:<32} {s.n_trials:>4} trials")
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from zenflow_triton.profiles import ProfileNotFoundError, describe, load_profile

    from .. import study as S

    try:
        prof = load_profile(args.name)
    except ProfileNotFoundError as e:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        url = storage_url(args)
        if storage_exists(args, url):
            try:
                st = S.open_study(args.name, S.make_storage(url), create=False)
            except KeyError:
                raise UsageError(str(e)) from None
            print(f"study {args.name!r} in {S.redact_url(url)}")
            print(S.format_table(st, top=10))
            return EXIT_OK
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(prof.to_dict(), indent=2))
    else:
        print(describe(prof))
    return EXIT_OK


def cmd_detect(args: argparse.Namespace) -> int:
    from ..detect import detect, host_adam_settings, measure_host_adam

    info = detect()
    if args.measure:
        info["host"]["host_adam_elements_per_s"] = measure_host_adam()
        info["host"]["host_adam_measured_with"] = host_adam_settings()
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    h = info["host"]
    print(f"host: {h['cpu']}; {h['usable_cpus']} usable CPUs, torch threads "
          f"{h['torch_threads']}, {h['memory_gb']} GB RAM")
    if "host_adam_elements_per_s" in h:
        how = h.get("host_adam_measured_with") or {}
        print(f"host AdamW (HostAdamW, {how.get('threads', '?')} threads, chunk_size "
              f"{how.get('chunk_size', '?')}): {h['host_adam_elements_per_s'] / 1e6:,.0f} "
              "M elements/s (fp32)")
    if not info["accelerators"]:
        print("accelerators: none (CPU only)")
    for a in info["accelerators"]:
        link = a.get("pcie")
        print(f"accelerator {a['index']}: {a['name']}, {a['memory_gb']} GB, capability "
              f"{a['capability']}" + (f", PCIe {link['current_link_speed']} "
                                      f"x{link['current_link_width']}" if link else ""))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    m = info["matching_profile"]
    print(f"matching built-in profile: {m}" if m else "matching built-in profile: none")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace) -> int:
    from .. import study as S
    from ..plots import MissingDependency, plot_study

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage_url(args)
    if not storage_exists(args, url):
        raise RuntimeError(f"no studies yet ({S.redact_url(url)} does not exist); "
                           "run `zenflow-tune run --quick` first")
    storage = S.make_storage(url)
    name = args.study
    if name is None:
        summaries = optuna.study.get_all_study_summaries(storage)
        if not summaries:
            raise RuntimeError(f"no studies in {S.redact_url(url)}")
        summaries.sort(key=lambda s: s.datetime_start or __import__("datetime").datetime.min)
        name = summaries[-1].study_name
    try:
        st = S.open_study(name, storage, create=False)
    except KeyError:
        raise RuntimeError(f"no study named {name!r} in {S.redact_url(url)}") from None
    out = (Path(args.out) if args.out
           else S.data_dir() / "plots" / slug(name, 60, fallback="study"))
    try:
        paths = plot_study(st, out)
    except MissingDependency as e:
        raise RuntimeError(str(e)) from None
    for p in paths:
        print(p)
    return EXIT_OK



def cmd_diagnose(args: argparse.Namespace) -> int:
    import time

    import torch

    from zenflow_triton.columns.spread import window_travel
    from zenflow_triton.diagnostics import GradientDiagnostics, kind_table, verdict

    from ..training import WorkloadError, build_workload, smollm2

    if not 0.0 < args.topk_ratio < 1.0:
        raise UsageError(f"--topk-ratio must be in (0, 1), got {args.topk_ratio}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.workload == "smollm2":
        name, factory = "smollm2", smollm2
    else:
        name, factory = load_workload(args.workload)
    try:
        wl = build_workload(factory, seed=args.seed, device=device, name=name)
    except WorkloadError as e:
        raise UsageError(f"--workload: {e}") from e
    model = wl.model
    # the weights as training starts (what the optimizer sees at its first selection)
    travel = window_travel(model.named_parameters(), args.lr, args.update_interval)
    diag = GradientDiagnostics(model.named_parameters(), topk_ratio=args.topk_ratio)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    t0 = time.perf_counter()
    for _, batch in zip(range(args.steps), wl.batches):
        opt.zero_grad(set_to_none=True)
        wl.loss_fn(model, batch).backward()
        diag.record()
        opt.step()
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    diag.to_json(out / "diagnostics.json")
    print(f"workload {name!r}, {diag.steps} AdamW steps at lr {args.lr} in {seconds:.0f} s")
    print(diag.table(args.rows))
    print()
    print(kind_table(diag.summary()))
    print()
    print(verdict(diag.summary(), travel))
    try:
        diag.plot(out / "diagnostics.png", title=f"{name}: gradient concentration and "
                                                 f"top-{args.topk_ratio:.0%} stability")
        print(f"wrote {out / 'diagnostics.json'} and {out / 'diagnostics.png'}")
    except ImportError:
        print(f"wrote {out / 'diagnostics.json'} (pip install matplotlib for the PNG)")
    return EXIT_OK


def storage_exists(args: argparse.Namespace, url: str) -> bool:
    """Whether there can be studies to read: a ``--storage`` given, or the default file there."""
    return bool(args.storage) or Path(url[len("sqlite:///"):]).exists()
