#!/usr/bin/env bash
# Set up, then run the main job on the embedded default (CPU, no download): a quick
# zenflow-tune study on a tiny decoder LM trained on Python's own docs, which saves the
# best feasible settings as a profile that ZenFlowOptimizer.from_profile(...) loads.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/zenflow-tune run --quick "$@"
