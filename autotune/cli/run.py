"""``zenflow-tune run``: a tuning study over :mod:`autotune.study` (measured: trials timed on
this machine) or :mod:`autotune.modelled` (speed from the step-time model of a hardware
profile, quality from the stored quality grid), and the profile it saves."""

from __future__ import annotations

import argparse
import sys
import time

import optuna
import torch

from zenflow_triton.config import ConfigError
from zenflow_triton.profiles import ProfileError, ProfileNotFoundError, validate_name

from .. import modelled as MD
from .. import study as S
from .. import training
from ..training import STUDY_LR, STUDY_WORKLOAD
from ..defaults import DEFAULT_LOSS_MARGIN, DEFAULT_LR
from ..detect import detect, hardware_slug
from ..names import code_key, slug
from ..objective import TuneSettings, guard_summary
from ..space import SearchSpace, betas_values
from .. import stepmodel as M
from ..stepmodel import DEFAULT_TOKENS, PRESETS
from . import EXIT_OK, EXIT_RUNTIME, FULL, QUICK, UsageError, load_workload, storage_url

LOSS_NAMES = {"logits": "fp32 logits", "chunked": "chunked cross-entropy"}
"""How the modelled objective's opening line names the loss it counts (``--loss``)."""
MEASURED_ONLY = ("quick", "n_trials", "timeout", "max_host_threads")
"""``run`` options that mean nothing to the modelled objective (its grid is fixed)."""


def cmd_run(args: argparse.Namespace) -> int:
    if not args.verbose:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.objective == "modelled":
        return run_modelled(args)
    return run_measured(args)


# ---- the measured objective -------------------------------------------------------------
def run_measured(args: argparse.Namespace) -> int:
    """``zenflow-tune run``: create or resume the study, run the trials it lacks, print the
    best ones and save the best feasible setting as a profile (unless ``--no-profile``)."""
    _check_measured_options(args)
    mode = QUICK if args.quick else FULL
    device = _device(args)  # before any work: not after the AdamW reference
    wl_name, factory, ts, space, explicit = _measured_settings(args, mode, device)
    if not 0 < args.prune_ratio < 1:
        raise UsageError(f"--prune-ratio must be in (0, 1), got {args.prune_ratio}")
    base_name, study_name, profile_name = _names(args, wl_name)
    n_trials = args.n_trials or mode["n_trials"]
    timeout = args.timeout if args.timeout is not None else mode["timeout"]
    prepare_workload(wl_name)  # once per machine, before the study's clock starts
    deadline = time.monotonic() + timeout if timeout else None
    url = storage_url(args)
    print(f"study {study_name!r} in {S.redact_url(url)}")
    if wl_name == training.DEFAULT_WORKLOAD:
        print(f"quality is judged on {wl_name!r}, the embedded tiny LM: a fast demo of the "
              "tuner, not a verdict on what you train (--workload module:function judges on "
              "your data; --objective modelled judges on real pretrained models)")
    if not args.study:
        older = S.other_studies(url, base_name, study_name)
        if older:
            print(f"not resumed: {len(older)} older stud{'y' if len(older) == 1 else 'ies'} of "
                  f"this workload made by other code, torch or thread count ("
                  f"{', '.join(older[:3])}{', ...' if len(older) > 3 else ''}); kept in the "
                  "storage, resume one with --study NAME")
    print(f"workload {wl_name!r} on {device}; target {n_trials} finished trials"
          + (f", at most {timeout:.0f}s" if timeout else ""))
    progress = _Progress()
    try:
        out = S.run_study(study_name=study_name, factory=factory, ts=ts, space=space,
                          n_trials=n_trials, storage_url=url, deadline=deadline,
                          explicit=explicit, profile_name=profile_name,
                          prune_ratio=args.prune_ratio, sampler_seed=args.sampler_seed,
                          log=say, progress=progress.trial_done, on_start=progress.start,
                          **heartbeat_options(args))
    except (S.StudyMismatchError, ConfigError) as e:
        raise UsageError(str(e))
    finally:
        progress.close()
    return _report_measured(out, args.top)


def _check_measured_options(args: argparse.Namespace) -> None:
    """No modelled-only option; ``--save-as`` is another name for ``--profile`` here."""
    modelled_only = [o for o, v in (("--model", args.model), ("--gpus", args.gpus != 1),
                                    ("--tokens", args.tokens), ("--mfu", args.mfu),
                                    ("--micro-batch-tokens", args.micro_batch_tokens),
                                    ("--loss", args.loss),
                                    ("--topk-grid", args.topk_grid),
                                    ("--interval-grid", args.interval_grid),
                                    ("--lean", args.lean != "auto"),
                                    ("--device-memory-gb", args.device_memory_gb),
                                    ("--host-memory-gb", args.host_memory_gb),
                                    ("--sharding", args.sharding != "ddp"),
                                    ("--quality", args.quality),
                                    ("--quality-bar", args.quality_bar != "tuned")) if v]
    if modelled_only:
        raise UsageError(f"{', '.join(modelled_only)}: only with --objective modelled")
    if args.save_as:
        if args.profile and args.profile != args.save_as:
            raise UsageError(f"--profile {args.profile!r} and --save-as {args.save_as!r}: "
                             "with the measured objective both name the profile to save; "
                             "give one")
        args.profile = args.save_as


def _device(args: argparse.Namespace) -> str:
    """``--device`` (default: cuda if available), checked to exist on this machine."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"--device {device!r}: {e}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {str(dev)!r}: this torch ({torch.__version__}) sees "
                             "no CUDA device on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {str(dev)!r}: only {torch.cuda.device_count()} CUDA "
                             "device(s) here")
    return device


def _measured_workload(args: argparse.Namespace) -> str | None:
    """``--workload``, or its default: without ``--quick``, where the study extras are
    installed, SmolLM2-135M fine-tuned on Python's docs (a real model: its verdict is one);
    else the embedded tiny LM."""
    if args.workload or args.quick or training.study_extras_missing():
        return args.workload
    say(f"tuning on {STUDY_WORKLOAD!r}: SmolLM2-135M fine-tuned on Python's docs (the study "
        f"extras are installed), by default {FULL['steps']} steps of 4 x 64 tokens a trial at "
        f"lr {STUDY_LR:g}; on 2 CPU cores a step takes about 3 s, a trial about 10 minutes, "
        f"{FULL['n_trials']} trials most of a day (the bar shows the time left; --n-trials, "
        "--steps, or --quick for the tiny LM's demo)")
    return STUDY_WORKLOAD


def _measured_settings(args: argparse.Namespace, mode: dict, device: str):
    """The workload (name, factory), the objective's :class:`TuneSettings`, the
    :class:`SearchSpace` and the objective settings given explicitly."""
    given = {k: getattr(args, k) for k in ("steps", "skip_steps", "lr", "seed", "loss_margin")
             if getattr(args, k) is not None}
    explicit = set(given) | ({"workload"} if args.workload else set()) | (
        {"device"} if args.device else set())
    if args.quick:
        explicit |= {"steps", "skip_steps"}
    wl_name, factory = load_workload(_measured_workload(args))
    steps = given.get("steps", mode["steps"])
    skip = given.get("skip_steps", min(mode["skip_steps"], max(0, steps // 5)))
    try:
        ts = TuneSettings(workload=wl_name, steps=steps, skip_steps=skip,
                          seed=given.get("seed", 0),
                          lr=given.get("lr", STUDY_LR if wl_name == STUDY_WORKLOAD
                                       else DEFAULT_LR),
                          loss_margin=given.get("loss_margin", DEFAULT_LOSS_MARGIN),
                          device=device)
        space = SearchSpace(max_host_threads=args.max_host_threads,
                            apply_delays=_delay_shares(args.delay_grid),
                            host_betas=_betas(args.betas_grid))
    except ValueError as e:
        raise UsageError(str(e))
    return wl_name, factory, ts, space, explicit


def _betas(text: str | None) -> tuple[str, ...] | None:
    """``--betas-grid``: the host_betas values to search (None: the library's)."""
    if not text:
        return None
    try:
        return betas_values([v.strip() for v in text.split(",") if v.strip()])
    except ValueError as e:
        raise ValueError(f"--betas-grid: {e}") from None


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


def _names(args: argparse.Namespace, wl_name: str) -> tuple[str, str, str | None]:
    """The default study name's stem (this hardware and workload), the study name and the
    profile to save (None: ``--no-profile``)."""
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
    return base_name, study_name, profile_name


class _Progress:
    """A line per finished trial, with the best feasible one so far: above a tqdm bar on
    stderr when it shows (a terminal), else on stdout."""

    def __init__(self) -> None:
        self.bar = None

    def start(self, finished: int, remaining: int) -> None:
        if finished:
            print(f"resuming: {finished} finished trial(s) kept, {remaining} to go")
        try:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=remaining, desc="trials", unit="trial", leave=False,
                            file=sys.stderr, disable=None)
        except ImportError:  # pragma: no cover - tqdm ships with optuna
            self.bar = None

    def trial_done(self, st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
        unit = st.user_attrs.get("reference", {}).get("unit", "items")
        best = S.feasible_trials(st.get_trials(deepcopy=False))
        best_s = (f"best feasible: #{best[0].number} {best[0].value:,.0f} {unit}/s"
                  if best else "best feasible: none yet")
        line = f"{S.describe_trial(tr, unit)}  | {best_s}"
        b = self.bar
        if b is not None and not b.disable:
            b.write(line)
            b.update(1)
            b.set_postfix_str(best_s)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _report_measured(out: S.RunOutcome, top: int) -> int:
    print()
    print(guard_summary(out.reference, out.settings.loss_margin))
    print(S.format_table(out.study, top=top))
    if out.best is None:
        print("\nno feasible trial: every completed setting missed the quality guard. "
              "Run more trials (--n-trials), more steps, or loosen --loss-margin.",
              file=sys.stderr)
        return EXIT_RUNTIME
    if out.profile_path is not None:
        print(f"\nsaved profile {out.profile.name!r} (trial {out.best.number}) to "
              f"{out.profile_path}")
        print_use_it(out.profile.name, f"{out.settings.lr:g}")
    return EXIT_OK


# ---- the modelled objective -------------------------------------------------------------
def run_modelled(args: argparse.Namespace) -> int:
    """``zenflow-tune run --objective modelled``: ``--profile`` is the hardware profile to
    model, ``--model`` the preset; the result is saved as ``--save-as`` (default
    ``<profile>-<model>``, so a built-in is not shadowed by accident) unless ``--no-profile``."""
    _check_modelled_options(args)
    try:
        prof, _ = MD.load_hardware(MD.profile_of(args.profile, args.device_memory_gb,
                                                 args.host_memory_gb))
    except ProfileNotFoundError as e:
        raise UsageError(f"--profile: {e}") from None
    except (MD.ModelledError, ProfileError) as e:
        raise UsageError(f"--profile {args.profile!r}: {e}") from None
    save_as = None
    if not args.no_profile:
        save_as = args.save_as or MD.default_save_name(prof.name, args.model, args.gpus,
                                                       args.tokens)
        try:
            validate_name(save_as)
        except ProfileError as e:
            raise UsageError(f"--save-as: {e}") from None
    lean = {"auto": None, "yes": True, "no": False}[args.lean]
    tokens = args.tokens or DEFAULT_TOKENS
    if args.micro_batch_tokens is not None and args.micro_batch_tokens > tokens:
        raise UsageError(f"--micro-batch-tokens {args.micro_batch_tokens} exceeds --tokens "
                         f"{tokens} (the tokens of a whole optimizer step)")
    micro = (f"micro-batches of {args.micro_batch_tokens}" if args.micro_batch_tokens else
             "each setting in its largest micro-batches that fit")
    loss = args.loss or "logits"
    where = (f"{args.model} on {prof.name!r} ({args.gpus} GPU(s), {args.sharding}, "
             f"{tokens} tokens/GPU/step, {micro}, the loss's {LOSS_NAMES[loss]}), speed from "
             "the step model")
    common = dict(profile=prof, model=args.model, gpus=args.gpus, tokens=args.tokens,
                  mfu=args.mfu, save_as=save_as, log=say, lean=lean, sharding=args.sharding,
                  micro_batch_tokens=args.micro_batch_tokens, loss=loss)
    if quality_source(args) == "real":
        _, grid = _quality_settings(args)  # (the grid options checked as for a workload)
        given = any(getattr(args, k) for k in ("topk_grid", "interval_grid", "delay_grid",
                                                "betas_grid"))
        print(f"modelled objective: {where}; quality from the real-model store (bar "
              f"{args.quality_bar!r}; nothing trained)", flush=True)
        out = MD.run_modelled(quality="real", bar=args.quality_bar,
                              grid=grid if given else None, **common)
        return _report_modelled(out, args.top)
    wl_name, factory = load_workload(args.workload)
    ts, grid = _quality_settings(args)
    prepare_workload(wl_name)  # once per machine, before any grid point trains
    url = storage_url(args)
    demo = ("" if args.workload else " (the embedded tiny LM: a fast demo of the tuner, not a "
            "verdict on real models: --quality real is)")
    print(f"modelled objective: {where}; quality measured on {wl_name!r} ({ts.device}) in "
          f"{S.redact_url(url)}{demo}", flush=True)
    out = MD.run_modelled(factory=factory, ts=ts, grid=grid, storage_url=url,
                          study_name=args.study, quality="workload", **common,
                          **heartbeat_options(args))
    return _report_modelled(out, args.top)


def quality_source(args: argparse.Namespace) -> str:
    """``--quality``, or its default: the real-model store, unless the user gave a
    ``--workload`` of their own (their data decides)."""
    if args.quality:
        return args.quality
    return "workload" if args.workload else "real"


def _check_modelled_options(args: argparse.Namespace) -> None:
    """``--profile`` and a known ``--model`` given, no measured-only option, ``--mfu`` in
    range."""
    if not args.profile or not args.model:
        missing = " and ".join(o for o, v in (("--profile NAME", args.profile),
                                               ("--model PRESET", args.model)) if not v)
        raise UsageError(f"--objective modelled needs {missing} (the hardware profile to model "
                         f"and a model preset: {', '.join(sorted(PRESETS))})")
    given = [o for o in MEASURED_ONLY if getattr(args, o, None) not in (None, False)]
    if given:
        opts = ", ".join("--" + o.replace("_", "-") for o in given)
        raise UsageError(f"{opts}: only for --objective measured (the modelled objective "
                         "trains a fixed quality grid; see --topk-grid and --interval-grid)")
    try:
        M.Workload.from_spec(args.model)
    except M.StepModelError as e:
        raise UsageError(f"--model: {e}") from None
    source = quality_source(args)
    if source == "real" and args.workload:
        raise UsageError("--workload: the real-model store judges quality on its own models; "
                         "give --quality workload to judge on yours")
    if source == "workload" and args.quality_bar != "tuned":
        raise UsageError("--quality-bar: only with --quality real (a workload's guard is "
                         "--loss-margin)")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UsageError(f"--mfu must be in (0, 1], got {args.mfu}")


def _quality_settings(args: argparse.Namespace) -> tuple[TuneSettings, MD.QualityGrid]:
    """The quality study's objective (the defaults, with the options given) and its grid
    (``--topk-grid``, ``--interval-grid``, ``--delay-grid``)."""
    over = {k: getattr(args, k) for k in ("steps", "skip_steps", "lr", "seed", "loss_margin",
                                          "device") if getattr(args, k) is not None}
    if "steps" in over and "skip_steps" not in over:
        over["skip_steps"] = min(TuneSettings().skip_steps, max(0, over["steps"] // 5))
    try:
        if args.workload == STUDY_WORKLOAD:  # (its own lr, not the tiny LM's)
            over.setdefault("lr", STUDY_LR)
        _, ts = MD.default_quality_settings(workload=args.workload, **over)
        grid_kw: dict = {}
        if args.topk_grid:
            grid_kw["topk_ratios"] = float_list(args.topk_grid, "--topk-grid", UsageError)
        if args.interval_grid:
            ints = float_list(args.interval_grid, "--interval-grid", UsageError)
            if any(v != int(v) for v in ints):
                raise UsageError(f"--interval-grid: expected integers, got "
                                 f"{args.interval_grid!r}")
            grid_kw["update_intervals"] = tuple(int(v) for v in ints)
        if args.delay_grid:
            grid_kw["apply_delays"] = float_list(args.delay_grid, "--delay-grid", UsageError)
        if args.betas_grid:
            grid_kw["host_betas"] = _betas(args.betas_grid)
        grid = MD.QualityGrid(**grid_kw)
        grid.points()
    except (ValueError, MD.ModelledError) as e:
        raise UsageError(str(e)) from None
    return ts, grid


def _report_modelled(out: MD.ModelledOutcome, top: int) -> int:
    print()
    print(MD.guard_line(out.store))
    print(MD.format_modelled_table(out, top=top))
    if out.best is None:
        why = ("no setting asked for is measured on real models" if not out.rows
               and out.store.real is not None
               else "no grid point fits in memory (device and host)"
               if not any(r.fits for r in out.rows)
               else "no feasible grid point fits in memory" if out.store.n_feasible
               else "every grid point missed the quality guard")
        hint = (("a smaller --model, fewer --tokens, --sharding fsdp2 with more --gpus"
                 + (", or --quality-bar tuned" if out.store.real.bar != "tuned" else "")
                 + "; or measure the settings on the real models (bench/convergence/study.py)")
                if out.store.real is not None else
                "a smaller --model, more --gpus, a finer grid, or a looser --loss-margin")
        print(f"\n{why}: nothing saved. Try {hint}.", file=sys.stderr)
        return EXIT_RUNTIME
    b = out.best
    print(f"\nchosen: topk_ratio={b.point.settings['topk_ratio']:g}, update_interval="
          f"{b.point.settings['update_interval']}, select_interval="
          f"{b.point.settings['select_interval']}, apply_delay="
          f"{b.point.settings.get('apply_delay')} ({MD.memory_side(b.settings)}): "
          f"{b.throughput:,.0f} tokens/s per GPU "
          f"(modelled, {b.step_time_s:.3f} s/step, stall {b.prediction.stall_fraction:.0%})")
    if out.profile_path is not None:
        print(f"saved profile {out.profile.name!r} to {out.profile_path}")
        print_use_it(out.profile.name, "...")
    return EXIT_OK


# ---- option handling of run -------------------------------------------------------------
def float_list(s: str, what: str, usage: type[Exception]) -> tuple[float, ...]:
    """A comma-separated list of numbers given to option ``what``; ``usage`` raised if not."""
    try:
        vals = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise usage(f"{what}: expected comma-separated numbers, got {s!r}") from None
    if not vals:
        raise usage(f"{what}: empty")
    return vals


def say(msg: str) -> None:
    """A line of progress on stdout, at once (the library's ``log`` callbacks)."""
    print(msg, flush=True)


def prepare_workload(name: str) -> None:
    """The work ``--workload`` needs once per machine (pretraining the embedded LM), before
    any study clock starts."""
    from .. import training

    try:
        training.prepare(name, log=say)
    except training.WorkloadError as e:
        raise UsageError(f"--workload: {e}") from None


def heartbeat_options(args: argparse.Namespace) -> dict[str, int]:
    """``--heartbeat-interval`` and ``--grace-period`` (hidden, for tests) when given."""
    kw = {}
    if args.heartbeat_interval:
        kw["heartbeat_interval"] = args.heartbeat_interval
    if args.grace_period:
        kw["grace_period"] = args.grace_period
    return kw


def print_use_it(profile: str, lr: str) -> None:
    """The footer of a run that saved a profile: how to use it."""
    print("use it:")
    print(f'    opt = ZenFlowOptimizer.from_profile("{profile}", model.named_parameters(), lr={lr})')
