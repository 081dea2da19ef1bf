"""Optuna tuner for ZenFlowOptimizer settings and the ``zenflow-tune`` CLI.

Library API (the CLI is a thin layer over it)::

    from autotune import SearchSpace, TuneSettings, run_study, tiny_lm
    out = run_study(study_name="mine", factory=tiny_lm, ts=TuneSettings(steps=60),
                    space=SearchSpace(), n_trials=12, profile_name="mine")
    out.profile_path   # the saved profile; ZenFlowOptimizer.from_profile("mine", ...)
"""

import importlib

# Lazy (PEP 562): ``zenflow-tune`` imports ``autotune.cli`` first, which says how to install
# Optuna when it is missing, instead of failing here on the package import.
_WHERE = {"Objective": "objective", "TuneSettings": "objective",
          "measure_reference": "objective", "train_and_measure": "objective",
          "SearchSpace": "space", "SlowTrialPruner": "study", "StudyMismatchError": "study",
          "data_dir": "study", "default_storage_url": "study", "feasible_trials": "study",
          "format_table": "study", "make_storage": "study", "profile_from_study": "study",
          "run_study": "study", "Workload": "training", "WorkloadError": "training",
          "load_workload_factory": "training", "tiny_lm": "training"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Objective", "TuneSettings", "measure_reference", "train_and_measure", "SearchSpace",
           "SlowTrialPruner", "StudyMismatchError", "data_dir", "default_storage_url",
           "feasible_trials", "format_table", "make_storage", "profile_from_study", "run_study",
           "Workload", "WorkloadError", "load_workload_factory", "tiny_lm"]
