"""The tuner's default objective settings, importable without Optuna (the CLI's help)."""

DEFAULT_LR = 3e-4
"""A fine-tuning learning rate: a tenth of the embedded workload's pretraining peak (3e-3)."""
DEFAULT_LOSS_MARGIN = 0.02
"""Feasible = held-out loss within 2% of AdamW's (see docs/tuning.md for why 2%)."""
