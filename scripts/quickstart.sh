#!/usr/bin/env bash
# Set up, then run the main job on the embedded default (CPU, no download): a quick
# zenflow-tune study that fine-tunes a tiny decoder LM (pretrained once on Python code, cached)
# on Python's own docs, and saves the best feasible settings as a profile that
# ZenFlowOptimizer.from_profile(...) loads.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/zenflow-tune run --quick "$@"
