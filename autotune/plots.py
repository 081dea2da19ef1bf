"""PNG plots of a study (``zenflow-tune plot``). matplotlib is optional and imported lazily."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from .objective import is_feasible

__all__ = ["MissingDependency", "plot_study"]


class MissingDependency(RuntimeError):
    pass


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise MissingDependency(
            "plotting needs matplotlib: pip install matplotlib "
            "(or pip install 'zenflow-triton[plot]')") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_study(study: optuna.Study, out_dir: str | Path) -> list[Path]:
    """Write history.png, importances.png (when computable) and quality.png; return paths."""
    plt = _matplotlib()
    from optuna.visualization import matplotlib as ovm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ref = study.user_attrs.get("reference", {})
    unit = ref.get("unit", "items")
    paths: list[Path] = []
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise RuntimeError(f"study {study.study_name!r} has no completed trial to plot")

    paths.append(_history(study, plt, ovm, out, unit))
    if len(complete) >= 2:
        p = _importances(study, plt, ovm, out)
        if p is not None:
            paths.append(p)
    paths.append(_quality(study, plt, complete, ref, unit, out))
    return paths


def _history(study: optuna.Study, plt: Any, ovm: Any, out: Path, unit: str) -> Path:
    """history.png: throughput by trial, the infeasible ones greyed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ax = ovm.plot_optimization_history(study, target_name=f"throughput ({unit}/s)")
    ax.set_title(f"{study.study_name}: history (infeasible greyed)")
    p = out / "history.png"
    ax.figure.set_size_inches(8, 5)
    ax.figure.tight_layout()
    ax.figure.savefig(p, dpi=110)
    plt.close(ax.figure)
    return p


def _importances(study: optuna.Study, plt: Any, ovm: Any, out: Path) -> Path | None:
    """importances.png, where Optuna can compute the parameter importances (else None)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ax = ovm.plot_param_importances(study, target_name="throughput")
        ax.set_title(f"{study.study_name}: importances for throughput")
        ax.figure.set_size_inches(8, 4.5)
        ax.figure.tight_layout()
        p = out / "importances.png"
        ax.figure.savefig(p, dpi=110)
        plt.close(ax.figure)
        return p
    except Exception as e:  # too few distinct trials for fANOVA, etc.
        print(f"(parameter importances skipped: {e})")
        return None


def _quality(study: optuna.Study, plt: Any, complete: list[Any], ref: dict[str, Any],
             unit: str, out: Path) -> Path:
    """quality.png: every trial's throughput against its held-out loss, the reference and
    the quality limit."""
    fig, ax = plt.subplots(figsize=(8, 5))
    feas = [t for t in complete if is_feasible(t)]
    infeas = [t for t in complete if not is_feasible(t) and t.user_attrs.get("heldout_loss")
              is not None]
    for group, color, label in ((feas, "tab:green", "feasible"),
                                (infeas, "tab:red", "infeasible (quality guard)")):
        if group:
            ax.scatter([t.user_attrs["heldout_loss"] for t in group], [t.value for t in group],
                       c=color, label=label, alpha=0.8)
            for t in group:
                ax.annotate(str(t.number), (t.user_attrs["heldout_loss"], t.value),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
    if ref:
        ax.scatter([ref["heldout_loss"]], [ref["throughput"]], marker="*", s=200, c="black",
                   label="torch AdamW (reference)")
    limits = {t.user_attrs.get("loss_limit") for t in complete} - {None}
    if limits:
        ax.axvline(max(limits), color="grey", ls="--", label="quality limit")
    ax.set_xlabel("held-out loss after the trial's steps (lower is better)")
    ax.set_ylabel(f"throughput ({unit}/s)")
    ax.set_title(f"{study.study_name}: throughput vs quality")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = out / "quality.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
