#!/usr/bin/env bash
# GPU check, one prepared run that stops itself within 5 minutes on a CUDA machine with no
# network (nothing is installed: torch, triton, numpy and pytest are enough; optuna is not
# needed, none of the tests run here uses it; pytest-timeout is used where it is there).
# Results in ${OUT:-results}/, 6 files (at most 7 ever):
#   env.txt          what Triton needs to build its launcher (a C compiler, Python.h) and
#                    numpy, found or MISSING; device, driver, library versions
#   tests.txt        the pytest output of each piece, one after the other: the kernel tests
#                    compiled for the GPU, the optimizer on CUDA with the Triton backend
#                    against the torch backend, the CUDA copy-pipeline tests, the counted
#                    syncs/launches (tests build their tensors on CUDA), the deferred NaN
#                    check, and the compiled variants per run (the JIT's own keys)
#   tests.xml        the junit reports of every piece, merged; rewritten after each piece, so
#                    a piece stopped at its limit loses only its own (marked as an error)
#   gpu_check.txt    bench/gpu_check.py: trajectory Triton vs torch on CUDA, host syncs per
#   gpu_check.json   step as CUDA counts them, kernel vs step time, GB/s vs HBM peak, memory
#                    (written after each of its sections, so a stop keeps what was done)
#   run.log          this script's own output
# Time: the whole run is planned in GPU_CHECK_BUDGET_S (270 s). Each pytest piece gets its
# own cap (a cold machine compiles ~220 kernel variants in the kernel piece), never more
# than leaves the pieces after it and gpu_check.py their share, and stops itself:
# pytest-timeout's --session-timeout between tests and --timeout per test where that plugin
# is there, and in any case SIGINT 10 s after its budget (pytest then still writes its
# report), SIGKILL 10 s after that; a piece left under 3 s is not run (reported).
# gpu_check.py gets what is left (at least 60 s), then SIGINT, then SIGKILL: at most about
# 280 s in all. The per-kernel bandwidth benchmarks (bench/bench_kernels.py) need
# pytest-benchmark and are not part of this check.
#
# Dry mode (GPU_CHECK_DRY=1, or --dry-run): every step up to the first CUDA call (the tool
# checks into env.txt, the $OUT layout, the pytest commands it would run, the pieces
# collected with --collect-only into tests.txt, gpu_check.py --help), then exit; no CUDA
# needed (tests/test_bench_smoke.py runs it on CPU). PYTHON names the interpreter (python3).
# Exit status: non-zero when a piece or gpu_check.py fails (dry mode: when the pieces do
# not collect or gpu_check.py does not start). A missing tool is reported, not fatal.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-results}"
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "usage: [OUT=dir] [GPU_CHECK_DRY=1] bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
  esac
done
[ "$DRY" = 1 ] || DRY=0
# The plan (GPU_CHECK_* override it, for tests of this script's own timing on CPU):
BUDGET_S="${GPU_CHECK_BUDGET_S:-270}"  # the whole run
CHECK_MIN_S="${GPU_CHECK_MIN_S:-60}"     # kept for gpu_check.py
PIECE_MIN_S="${GPU_CHECK_PIECE_MIN_S:-20}"  # kept for each piece still to come
GRACE_S="${GPU_CHECK_GRACE_S:-10}"     # SIGINT this long after a budget, SIGKILL as long after
OVERRUN_S=$((2 * GRACE_S))             # so a piece may run this much past its budget
START=$SECONDS
mkdir -p "$OUT"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"  # per-piece reports, not in $OUT
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec > >(tee "$OUT/run.log") 2>&1

# The pytest pieces, in order: "file cap_seconds" (GPU_CHECK_PIECES: others, one a line).
PIECES=(
  "tests/test_kernels.py 110"
  "tests/test_triton_backend.py 50"
  "tests/test_cuda_pipeline.py 40"
  "tests/test_gpu_discipline.py 40"
  "tests/test_deferred_finite.py 25"
  "tests/test_specialisation.py 30"
)
if [ -n "${GPU_CHECK_PIECES:-}" ]; then
  mapfile -t PIECES <<< "$GPU_CHECK_PIECES"
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

# ------------------------------------------------------------------ what Triton needs
{
  echo "mode: $([ "$DRY" = 1 ] && echo dry || echo run)"
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  if command -v "$PY" >/dev/null 2>&1; then
    echo "python: $(command -v "$PY")"
  else
    echo "python: MISSING ($PY not found)"
  fi
  # Triton builds its launcher with $CC, else gcc, else clang.
  cc_found=""
  for c in ${CC:-} gcc clang cc; do
    if command -v "$c" >/dev/null 2>&1; then cc_found="$(command -v "$c")"; break; fi
  done
  if [ -z "$cc_found" ]; then
    echo "C compiler: MISSING (Triton needs \$CC, gcc or clang to build its launcher)"
  else
    echo "C compiler: $cc_found"
  fi
  # One interpreter start for the rest: Python.h where Triton looks for it, the modules.
  "$PY" - <<'PYEOF' 2>&1
import importlib
import importlib.metadata as md
import os
import sys
import sysconfig

print(f"python version: {sys.version.split()[0]}")
scheme = sysconfig.get_default_scheme()
scheme = "posix_prefix" if scheme == "posix_local" else scheme  # as Triton does
inc = sysconfig.get_paths(scheme=scheme)["include"]
if os.path.isfile(os.path.join(inc, "Python.h")):
    print(f"Python headers: {os.path.join(inc, 'Python.h')}")
else:
    print(f"Python headers: MISSING (no Python.h in {inc!r}: Triton cannot build its launcher)")
for mod in ("numpy", "torch", "triton", "pytest"):
    try:
        print(f"{mod}: {importlib.import_module(mod).__version__}")
    except Exception as e:
        print(f"{mod}: MISSING ({type(e).__name__}: {e})")
if "torch" in sys.modules:
    print(f"torch built for CUDA: {sys.modules['torch'].version.cuda}")
try:
    v = md.version("pytest-timeout")
    major, minor = (int(x) for x in v.split(".")[:2])
    print(f"pytest-timeout: {v}" + (" (with --session-timeout)" if (major, minor) >= (2, 3)
                                    else ""))
except Exception:
    print("pytest-timeout: no (each piece is stopped by SIGINT only)")
try:
    print(f"optuna: {md.version('optuna')} (not needed)")
except Exception:
    print("optuna: no (not needed: none of the tests run here uses it)")
PYEOF
} > "$OUT/env.txt" 2>&1
MISSING="$(grep -E '^[A-Za-z. ]+: MISSING' "$OUT/env.txt" | sed 's/: MISSING.*//' | paste -sd, -)"
MISSING="${MISSING:-nothing}"
echo "missing: $MISSING" >> "$OUT/env.txt"
cat "$OUT/env.txt"
if [ -z "${CC:-}" ] && ! command -v gcc >/dev/null 2>&1 && ! command -v clang >/dev/null 2>&1 \
    && command -v cc >/dev/null 2>&1; then
  export CC="$(command -v cc)"  # Triton looks for gcc and clang by name only
  echo "no gcc or clang: CC=$CC exported for Triton" | tee -a "$OUT/env.txt"
fi

TIMEOUT_OPTS=()
if grep -q '^pytest-timeout: [0-9]' "$OUT/env.txt"; then
  grep -q -- '--session-timeout' "$OUT/env.txt" && TIMEOUT_OPTS=(--session-timeout)
  TIMEOUT_OPTS+=(--timeout)
fi

# ------------------------------------------------------------------ the pieces' time
elapsed() { echo $((SECONDS - START)); }

# piece_budget INDEX: seconds for piece INDEX now, leaving the pieces after it and
# gpu_check.py their share, and this piece its possible overrun.
piece_budget() {
  local i="$1" cap left
  cap="${PIECES[$i]##* }"
  left=$(( BUDGET_S - $(elapsed) - (${#PIECES[@]} - i - 1) * PIECE_MIN_S - CHECK_MIN_S - OVERRUN_S ))
  [ "$left" -lt "$cap" ] && cap="$left"
  echo "$cap"
}

# pytest_opts BUDGET: a piece's stop-itself options, one a line.
pytest_opts() {
  local b="$1" per=$(( $1 < 90 ? $1 : 90 )) o
  for o in ${TIMEOUT_OPTS[@]+"${TIMEOUT_OPTS[@]}"}; do
    case "$o" in
      --session-timeout) echo "--session-timeout=$b" ;;
      --timeout) echo "--timeout=$per" ;;
    esac
  done
}

merge_reports() {  # every piece's junit report so far, or an error for one that left none
  "$PY" - "$WORK" "$OUT/tests.xml" "${DONE[@]}" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, done = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
root = ET.Element("testsuites", name="bench/gpu_check.sh")
for i, name in enumerate(done):
    try:
        suites = ET.parse(work / f"piece{i}.xml").getroot()
        suites = list(suites) if suites.tag == "testsuites" else [suites]
    except (OSError, ET.ParseError) as e:
        suite = ET.Element("testsuite", name=name, tests="1", errors="1", failures="0",
                           skipped="0")
        case = ET.SubElement(suite, "testcase", classname=name, name="(the piece)")
        ET.SubElement(case, "error", message=f"no junit report ({type(e).__name__}): not "
                      "run, stopped at its limit or crashed; see tests.txt")
        suites = [suite]
    for suite in suites:
        suite.set("name", name)
        root.append(suite)
ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)
PYEOF
}

# ------------------------------------------------------------------ dry mode
if [ "$DRY" = 1 ]; then
  rc=0
  files=()
  echo "dry run: these pytest pieces would run (budgets with no time spent yet):"
  for i in "${!PIECES[@]}"; do
    file="${PIECES[$i]% *}"
    files+=("$file")
    b="$(piece_budget "$i")"
    echo "  piece $i: timeout -s INT -k $GRACE_S $((b + GRACE_S)) ${PYTEST[*]} $file" \
         "--junitxml=$WORK/piece$i.xml $(pytest_opts "$b" | paste -sd' ' -)"
  done
  echo "  then: timeout -s INT -k $GRACE_S <time left, >= $CHECK_MIN_S> $PY bench/gpu_check.py --out $OUT"
  # Collected here (on CPU), all pieces in one interpreter: they import the same modules.
  "${PYTEST[@]}" --collect-only "${files[@]}" > "$OUT/tests.txt" 2>&1
  crc=$?
  for file in "${files[@]}"; do
    echo "  collect $file: $(grep -c "^$file::" "$OUT/tests.txt") tests"
  done
  echo "  collect: rc=$crc, $(grep -Eo '[0-9]+ tests? collected' "$OUT/tests.txt" | tail -n 1)"
  [ "$crc" -eq 0 ] || rc=1
  if "$PY" bench/gpu_check.py --help > /dev/null 2>&1; then
    echo "  gpu_check.py --help: ok"
  else
    echo "  gpu_check.py --help: FAILED"; rc=1
  fi
  echo "dry run: $([ "$rc" -eq 0 ] && echo OK || echo FAILED); missing: $MISSING; $(elapsed) s"
  exit "$rc"
fi

# ------------------------------------------------------------------ the run
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)" 2>&1
} >> "$OUT/env.txt" 2>&1
tail -n 2 "$OUT/env.txt"

: > "$OUT/tests.txt"
DONE=()
tests_rc=0
for i in "${!PIECES[@]}"; do
  file="${PIECES[$i]% *}"
  b="$(piece_budget "$i")"
  DONE+=("$file")
  if [ "$b" -lt 3 ]; then
    echo "=== piece $i: $file: not run, no time left ($(elapsed) s spent)" | tee -a "$OUT/tests.txt"
    tests_rc=1
    merge_reports
    continue
  fi
  mapfile -t opts < <(pytest_opts "$b")
  echo "=== piece $i: $file, budget $b s, at $(elapsed) s" | tee -a "$OUT/tests.txt"
  timeout -s INT -k "$GRACE_S" $((b + GRACE_S)) "${PYTEST[@]}" "$file" --junitxml="$WORK/piece$i.xml" \
    ${opts[@]+"${opts[@]}"} 2>&1 | tee "$WORK/piece$i.txt" >> "$OUT/tests.txt"
  prc=${PIPESTATUS[0]}
  echo "=== piece $i: rc=$prc (124 = stopped at its limit) at $(elapsed) s" >> "$OUT/tests.txt"
  grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)' "$WORK/piece$i.txt" | tail -n 8
  echo "piece $i ($file): rc=$prc"
  [ "$prc" -eq 0 ] || tests_rc=1
  merge_reports
done

left=$(( BUDGET_S - $(elapsed) ))
[ "$left" -lt "$CHECK_MIN_S" ] && left="$CHECK_MIN_S"
echo "gpu_check.py: $left s, at $(elapsed) s"
timeout -s INT -k "$GRACE_S" "$left" "$PY" bench/gpu_check.py --out "$OUT"
check_rc=$?

echo "tests rc=$tests_rc gpu_check rc=$check_rc (124 = stopped at its limit);" \
     "missing: $MISSING; $(elapsed) s"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]
