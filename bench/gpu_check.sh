#!/usr/bin/env bash
# GPU check: the kernel tests compiled for the GPU (no interpreter), the host pipeline's CUDA
# tests (copy stream ordering, CUDA params following the CPU run), then the kernel
# benchmarks and the ZeRO-Offload pipeline on CUDA params. Results go to ${OUT:-results}/:
#   env.txt                     device, driver, library versions
#   test_kernels.txt / .xml     pytest output and JUnit XML of tests/test_kernels.py
#   bench_kernels.txt           benchmark summary (GB/s vs peak and copy; speedups)
#   bench_kernels_summary.json  the same as JSON
#   bench_kernels.json          pytest-benchmark's full JSON
#   bench_kernels_pytest.txt    pytest output of the benchmarks
#   test_pipeline.txt           pytest output of tests/test_cuda_pipeline.py + test_triton_backend.py
#   bench_pipeline.txt          host pipeline on CUDA params: step() vs plain host AdamW
# Budget: under 9 minutes (kernel tests 270 s, pipeline tests 90 s, kernel benchmarks
# 120 s, pipeline benchmark 60 s, each killed at its limit).
# Exit status: non-zero when the tests or the benchmarks fail.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-results}"
mkdir -p "$OUT"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

timeout 270 python3 -m pytest tests/test_kernels.py -q -p no:cacheprovider \
  --junitxml="$OUT/test_kernels.xml" > "$OUT/test_kernels.txt" 2>&1
tests_rc=$?
tail -n 25 "$OUT/test_kernels.txt"

timeout 90 python3 -m pytest tests/test_cuda_pipeline.py tests/test_triton_backend.py -q \
  -p no:cacheprovider -rs > "$OUT/test_pipeline.txt" 2>&1
pipe_rc=$?
tail -n 15 "$OUT/test_pipeline.txt"

ZENFLOW_BENCH_OUT="$OUT" timeout 120 python3 -m pytest bench/bench_kernels.py -q -s \
  -p no:cacheprovider --benchmark-json="$OUT/bench_kernels.json" \
  > "$OUT/bench_kernels_pytest.txt" 2>&1
bench_rc=$?
if [ -f "$OUT/bench_kernels.txt" ]; then cat "$OUT/bench_kernels.txt"; else tail -n 40 "$OUT/bench_kernels_pytest.txt"; fi

timeout 60 python3 -m pytest bench/bench_host.py -q -s -p no:cacheprovider -k "pipeline and cuda" \
  > "$OUT/bench_pipeline.txt" 2>&1
bench_pipe_rc=$?
grep -E "^host|passed|failed|skipped" "$OUT/bench_pipeline.txt" || tail -n 20 "$OUT/bench_pipeline.txt"

echo "kernel tests rc=$tests_rc pipeline tests rc=$pipe_rc kernel bench rc=$bench_rc" \
  "pipeline bench rc=$bench_pipe_rc (124 = timed out)"
[ "$tests_rc" -eq 0 ] && [ "$pipe_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$bench_pipe_rc" -eq 0 ]
