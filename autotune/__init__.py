"""Optuna tuner for ZenFlowOptimizer settings and the ``zenflow-tune`` CLI.

Library API (the CLI is a thin layer over it)::

    from autotune import SearchSpace, TuneSettings, run_study, tiny_lm
    out = run_study(study_name="mine", factory=tiny_lm, ts=TuneSettings(steps=60),
                    space=SearchSpace(), n_trials=12, profile_name="mine")
    out.profile_path   # the saved profile; ZenFlowOptimizer.from_profile("mine", ...)
"""

from .objective import Objective, TuneSettings, measure_reference, train_and_measure
from .space import SearchSpace
from .study import (SlowTrialPruner, StudyMismatchError, data_dir, default_storage_url,
                    feasible_trials, format_table, make_storage, profile_from_study, run_study)
from .workload import Workload, WorkloadError, load_workload_factory, tiny_lm

__all__ = ["Objective", "TuneSettings", "measure_reference", "train_and_measure", "SearchSpace",
           "SlowTrialPruner", "StudyMismatchError", "data_dir", "default_storage_url",
           "feasible_trials", "format_table", "make_storage", "profile_from_study", "run_study",
           "Workload", "WorkloadError", "load_workload_factory", "tiny_lm"]
