#!/usr/bin/env bash
# Create .venv (once) and install zenflow-triton with the tuner, test and plot extras.
# torch: the CPU wheel 2.13.0 first, so the package's torch range installs nothing more
# (a bare "torch" requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[tune,test,plot]"
