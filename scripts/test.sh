#!/usr/bin/env bash
# Set up, then run the test suite and the benchmarks in quick mode (so they cannot rot).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# Two workers: this machine's 2 cores (10 min instead of 15 for the suite here).
.venv/bin/python -m pytest tests -q --timeout=600 -n 2 --dist worksteal
# The tests that compare two implementations once more on the code paths another x86 CPU
# would take (MKL's portable kernels or its SSE4.2 ones, ATen without vectorisation): their
# tolerances must come from fp32 rounding, not from this CPU's last bits.
for other_cpu in "MKL_CBWR=COMPATIBLE ATEN_CPU_CAPABILITY=default" "MKL_ENABLE_INSTRUCTIONS=SSE4_2"; do
    env $other_cpu .venv/bin/python -m pytest -q --timeout=600 -p no:cacheprovider -n 2 \
        tests/test_equivalence.py tests/test_stress.py tests/test_triton_backend.py \
        tests/test_host_adamw.py tests/test_contract.py
done
ZENFLOW_BENCH_QUICK=1 .venv/bin/python -m pytest bench -q --timeout=600 \
    --benchmark-disable-gc --benchmark-min-rounds=1 --benchmark-max-time=0.5 \
    --benchmark-warmup=off
