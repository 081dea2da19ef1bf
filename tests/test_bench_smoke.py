"""Guard: the kernel benchmarks must actually run in CI's benchmark step, not be skipped.

CI (``scripts/test.sh``) runs ``ZENFLOW_BENCH_QUICK=1 pytest bench ...`` on a machine without
CUDA. bench/bench_kernels.py then has to run its CPU smoke mode (Triton interpreter, tiny
shapes). If it skipped everything again, its code could rot unseen; this test runs it the
way CI does, in a subprocess with CUDA hidden, and fails unless its benchmarks passed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = "bench/bench_kernels.py"
TIMEOUT_S = 300
# The options scripts/test.sh gives the benchmark run.
CI_ARGS = ["--benchmark-disable-gc", "--benchmark-min-rounds=1", "--benchmark-max-time=0.5",
           "--benchmark-warmup=off"]


def _ci_env() -> dict[str, str]:
    """This environment as CI's benchmark step sees it: ZENFLOW_BENCH_QUICK=1, no CUDA
    device, and nothing else that would switch the smoke mode or the interpreter on for it
    (so the bench files have to do that themselves)."""
    env = dict(os.environ)
    for var in ("ZENFLOW_BENCH_CPU_SMOKE", "TRITON_INTERPRET", "ZENFLOW_BENCH_OUT",
                "ZENFLOW_BENCH_JSON", "PYTEST_ADDOPTS"):
        env.pop(var, None)
    env.update(ZENFLOW_BENCH_QUICK="1", CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1")
    return env


def _count(summary: str, word: str) -> int:
    m = re.search(rf"(\d+) {word}", summary)
    return int(m.group(1)) if m else 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: the kernel benchmarks cannot run here")
def test_kernel_benchmarks_run_in_ci_quick_mode():
    cmd = [sys.executable, "-m", "pytest", BENCH, "-q", "-rs", "-p", "no:cacheprovider",
           *CI_ARGS]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_ci_env(), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the kernel benchmarks' smoke run took over {TIMEOUT_S} s (it should take "
                    f"seconds; shrink the CPU shapes in {BENCH}). Output so far:\n"
                    f"{e.stdout or ''}{e.stderr or ''}")
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|skipped|failed)", ln)]
    summary = lines[-1] if lines else ""
    passed, skipped = _count(summary, "passed"), _count(summary, "skipped")
    failed, errors = _count(summary, "failed"), _count(summary, "error")
    detail = f"\n$ {' '.join(cmd)}\nexit status {proc.returncode}\n{out[-6000:]}"
    assert proc.returncode == 0, f"the kernel benchmarks' smoke run failed:{detail}"
    assert failed == 0 and errors == 0, f"benchmarks failed:{detail}"
    assert skipped == 0, (f"{skipped} kernel benchmarks were skipped in CI's quick mode "
                          f"(they must run on CPU in the Triton interpreter):{detail}")
    # Every kernel, both implementations: far more than one test; the copy baseline alone
    # (which needs no Triton) does not count as the benchmarks having run.
    assert passed > 1, f"no kernel benchmark ran (summary: {summary!r}):{detail}"


def test_gpu_check_script_runs_in_cpu_smoke_mode(tmp_path):
    """bench/gpu_check.py runs only where a GPU is lent; its --cpu-smoke mode (tiny sizes,
    Triton interpreter) runs the same code here so it cannot rot: it must finish, say OK,
    and write its two result files with the trajectory check passed."""
    import json

    env = _ci_env()
    env.pop("ZENFLOW_BENCH_QUICK", None)
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-smoke", "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "gpu_check.py: OK" in out, out[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["trajectory"]["ok"] and report["trajectory"]["columns_migrated"][0] > 0
    assert report["syncs"]["steady"]["blocking_transfers"] == 0
    assert (tmp_path / "gpu_check.txt").exists()
