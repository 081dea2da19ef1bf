"""Guard: the kernel benchmarks must actually run in CI's benchmark step, not be skipped.

CI (``scripts/test.sh``) runs ``ZENFLOW_BENCH_QUICK=1 pytest bench ...`` on a machine without
CUDA. bench/bench_kernels.py then has to run its CPU smoke mode (Triton interpreter, tiny
shapes). If it skipped everything again, its code could rot unseen; this test runs it the
way CI does, in a subprocess with CUDA hidden, and fails unless its benchmarks passed.

Likewise for what runs only where a GPU is lent: bench/gpu_check.py in its CPU smoke mode,
and bench/gpu_check.sh in its dry mode (its checks, its plan, its pieces collected) and, with
stand-in pieces, its real mode's way of stopping itself while keeping every report.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support.helpers import tree_env

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
    env = tree_env()
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


GPU_CHECK = "bench/gpu_check.sh"
GPU_CHECK_FILES = 7  # what comes back from the GPU machine: at most 8 files; the script keeps 7
PIECE_FILES = ["tests/test_kernels.py", "tests/test_triton_backend.py",
               "tests/test_cuda_pipeline.py", "tests/test_gpu_discipline.py",
               "tests/test_deferred_finite.py", "tests/test_specialisation.py"]


def _gpu_check_env(out: Path, **extra: str) -> dict[str, str]:
    env = _ci_env()
    env.pop("ZENFLOW_BENCH_QUICK", None)
    for var in [v for v in env if v.startswith("GPU_CHECK_")]:
        env.pop(var)
    env.update(OUT=str(out), PYTHON=sys.executable, **extra)
    return env


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_gpu_check_refuses_an_unknown_argument():
    """bench/gpu_check.sh takes --dry-run (or GPU_CHECK_DRY=1) and nothing else: anything
    else prints its usage and exits 2 before doing anything."""
    proc = subprocess.run(["bash", GPU_CHECK, "--dry"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr and "--dry-run" in proc.stderr


# One of the two ways in: they set the same variable on the script's first lines (the
# whole dry run is ~20 s of collecting the pieces, so it runs once in CI).
@pytest.mark.parametrize("how", ["flag"])
def test_gpu_check_dry_mode_runs_here(tmp_path, how):
    """bench/gpu_check.sh runs where a GPU is lent, once, with no network: its dry mode
    (GPU_CHECK_DRY=1 or --dry-run) does everything up to the first CUDA call here. It checks
    what Triton needs to build its launcher (a C compiler, Python.h) and numpy, says what it
    would run, collects every piece, and exits 0 with env.txt, tests.txt and run.log in OUT
    (within the 7 files the script may leave)."""
    import shutil
    import sysconfig

    out = tmp_path / "out"
    env = _gpu_check_env(out, **({"GPU_CHECK_DRY": "1"} if how == "env" else {}))
    args = ["bash", GPU_CHECK] + (["--dry-run"] if how == "flag" else [])
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert _files(out) == ["env.txt", "run.log", "tests.txt"], _files(out)
    assert len(_files(out)) <= GPU_CHECK_FILES
    env_txt = (out / "env.txt").read_text()
    assert "mode: dry" in env_txt
    # What Triton needs, found where this machine has it (MISSING where it has not).
    cc = next((shutil.which(c) for c in (os.environ.get("CC"), "gcc", "clang", "cc")
               if c and shutil.which(c)), None)
    assert (f"C compiler: {cc}" if cc else "C compiler: MISSING") in env_txt, env_txt
    scheme = sysconfig.get_default_scheme()  # where Triton looks for Python.h
    inc = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)[
        "include"]
    has_h = (Path(inc) / "Python.h").is_file()
    assert ("Python headers: " + str(Path(inc) / "Python.h") if has_h
            else "Python headers: MISSING") in env_txt, env_txt
    import numpy
    assert f"numpy: {numpy.__version__}" in env_txt
    assert "missing: " in env_txt
    # The commands it would run, each piece stopping itself, and all of them collected.
    for i, f in enumerate(PIECE_FILES):
        line = next(ln for ln in log.splitlines() if ln.startswith(f"  piece {i}: "))
        assert f" {f} --junitxml=" in line and "timeout -s INT" in line, line
        assert re.search(rf"collect {re.escape(f)}: [1-9]\d* tests", log), log
    assert "gpu_check.py --help: ok" in log
    assert "dry run: OK" in log
    tests_txt = (out / "tests.txt").read_text()
    assert all(f"{f}::" in tests_txt for f in PIECE_FILES)
    assert re.search(r"\d+ tests collected in", tests_txt), tests_txt[-2000:]
    assert "dry run: OK" in (out / "run.log").read_text()
    assert not any((tmp_path / "out").glob("*.xml"))  # nothing ran


def test_gpu_check_stops_its_pieces_and_keeps_their_reports(tmp_path):
    """The real mode's timing, on CPU with stand-in pieces (GPU_CHECK_PIECES) and a short
    plan: a piece that outruns its budget is stopped in time and its report is kept (the
    test that ran passed, the one that hung failed or was cut, the rest never started), a
    piece left without time is not run and shows as an error, the reports are merged into
    one tests.xml, at most 7 files are left, and the exit status says it failed
    (gpu_check.py, with no CUDA here, exits 2)."""
    import time
    import xml.etree.ElementTree as ET

    fake = tmp_path / "pieces"
    fake.mkdir()
    (fake / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_hangs():\n    time.sleep(120)\n"
        "\ndef test_after():\n    pass\n")
    (fake / "test_ok.py").write_text("def test_ok():\n    pass\n")
    pieces = f"{fake / 'test_slow.py'} 4\n{fake / 'test_ok.py'} 20\n{fake / 'test_ok.py'} 2"
    out = tmp_path / "out"
    env = _gpu_check_env(out, GPU_CHECK_PIECES=pieces, GPU_CHECK_BUDGET_S="90",
                         GPU_CHECK_MIN_S="5", GPU_CHECK_PIECE_MIN_S="1", GPU_CHECK_GRACE_S="3")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", GPU_CHECK], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    took = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert "gpu_check rc=2" in log, log[-3000:]
    assert took < 60, f"{took:.0f} s: the hanging test was not stopped at its budget\n{log}"
    files = _files(out)
    assert files == ["env.txt", "run.log", "tests.txt", "tests.xml"], files
    suites = ET.parse(out / "tests.xml").getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [str(fake / "test_slow.py"),
                                               str(fake / "test_ok.py"),
                                               str(fake / "test_ok.py")]
    slow = {c.get("name"): c for c in suites[0].iter("testcase") if c.get("name")}
    assert "test_fast" in slow and not list(slow["test_fast"]), ET.tostring(suites[0])
    assert "test_after" not in slow  # the session stopped after the hung test
    assert [c.get("name") for c in suites[1].iter("testcase")] == ["test_ok"]
    assert suites[2].get("errors") == "1"  # the piece left no time: not run, reported
    assert "not run, no time left" in (out / "tests.txt").read_text()
