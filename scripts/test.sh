#!/usr/bin/env bash
# Set up, then run the test suite and the benchmarks in quick mode (so they cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
.venv/bin/python -m pytest tests -q --timeout=600
ZENFLOW_BENCH_QUICK=1 .venv/bin/python -m pytest bench -q --timeout=600 \
    --benchmark-disable-gc --benchmark-min-rounds=1 --benchmark-max-time=0.5 \
    --benchmark-warmup=off
