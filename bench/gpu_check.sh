#!/usr/bin/env bash
# GPU check, one prepared run of under 5 minutes on a CUDA machine (nothing to install:
# torch, triton, numpy and pytest are enough). Results in ${OUT:-results}/, 6 files:
#   env.txt          device, driver, library versions
#   tests.txt/.xml   the kernel tests compiled for the GPU, the optimizer on CUDA with the
#                    Triton backend against the torch backend, the CUDA copy-pipeline tests
#                    and the counted syncs/launches (tests build their tensors on CUDA)
#   gpu_check.txt    bench/gpu_check.py: trajectory Triton vs torch on CUDA, host syncs per
#   gpu_check.json   step as CUDA counts them, kernel vs step time, GB/s vs HBM peak, memory
#                    (written after each of its sections, so a timeout keeps what was done)
#   run.log          this script's own output
# Budget: tests 200 s (a cold machine compiles ~220 kernel variants), gpu_check.py 90 s;
# each killed at its limit. The per-kernel bandwidth benchmarks (bench/bench_kernels.py)
# need pytest-benchmark and are not part of this check.
# Exit status: non-zero when the tests or gpu_check.py fail.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-results}"
mkdir -p "$OUT"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

timeout 200 python3 -m pytest tests/test_kernels.py tests/test_triton_backend.py \
  tests/test_cuda_pipeline.py tests/test_gpu_discipline.py -q -p no:cacheprovider -rs \
  --junitxml="$OUT/tests.xml" > "$OUT/tests.txt" 2>&1
tests_rc=$?
tail -n 25 "$OUT/tests.txt"

timeout 90 python3 bench/gpu_check.py --out "$OUT"
check_rc=$?

echo "tests rc=$tests_rc gpu_check rc=$check_rc (124 = timed out)"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
