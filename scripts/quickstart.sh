#!/usr/bin/env bash
# Set up, then run the main job on the embedded default (CPU, no download):
# AdamW and ZenFlow side by side on a tiny decoder LM trained on Python's own docs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_compare.py --steps 60 --lr 1e-3 "$@"
