"""Stress check of teardown (issue 49): run an example many times, several at once, with a
CPU-saturating process beside them, and count the runs that abort (a rank killed by a
signal), hang (past ``--timeout``) or end with another result than the first run's.

    python bench/stress_teardown.py --example ddp --runs 100 --concurrency 3 --hog 1

* ``ddp``: ``torchrun --standalone --nproc_per_node 2 examples/train_ddp.py --steps S``
  (2 gloo ranks: DDP, ``finish()``, ``close()``, ``destroy_process_group()``, exit);
* ``fsdp2``: the same with ``examples/train_fsdp2.py``;
* ``single``: one process, the tiny LM trained with ``finish()`` and ``close()``.

Every run has ``PYTHONFAULTHANDLER=1`` (an abort prints each thread's Python stack) and
``ZENFLOW_STACKS_ON_USR1=1`` (the examples dump every thread's stack on SIGUSR1, which this
script sends to a hung run's processes before killing them, after a ``py-spy dump --native``
of each where py-spy is installed). A rank the launcher leaves behind after it exits (torchrun
does, when its other rank is done) counts as a hang once it outlives ``--timeout``. The log of every failed run is
kept under ``--logs``. Exit status 1 when any run aborted, hung or differed.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SINGLE = """
import sys, torch
sys.path.insert(0, {root!r})
from autotune.training import tiny_lm
from zenflow_triton import ZenFlowOptimizer
torch.manual_seed(0)
wl = tiny_lm(seed=0)
opt = ZenFlowOptimizer(wl.model.named_parameters(), lr=1e-3, min_offload_numel=1024)
for _ in range({steps}):
    wl.loss_fn(wl.model, next(wl.batches)).backward()
    opt.step()
    opt.zero_grad()
opt.close()
v = torch.cat([p.detach().reshape(-1) for p in wl.model.parameters()]).double()
print(f"checksum {{v.sum().item():.17g}} {{(v * v.cumsum(0)).sum().item():.17g}}")
"""


def command(example: str, steps: int) -> list[str]:
    if example == "single":
        return [sys.executable, "-c", SINGLE.format(root=str(ROOT), steps=steps)]
    script = {"ddp": "examples/train_ddp.py", "fsdp2": "examples/train_fsdp2.py"}[example]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", "2", script, "--steps", str(steps)]


def one(i: int, args) -> tuple[str, str, str]:
    """(verdict, checksum, log) of run ``i``: "ok", "abort", "hang" or "error"."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1", ZENFLOW_STACKS_ON_USR1="1",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    log = Path(args.logs) / f".run-{i}.out"  # a file, not a pipe: orphans cannot block us
    with open(log, "w") as f:
        proc = subprocess.Popen(command(args.example, args.steps), cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
            time.sleep(0.5)
            left = descendants(proc.pid) + orphans(log)
            if left:  # the launcher is done, a rank is not (torchrun left it behind)
                deadline = time.time() + args.timeout
                while left and time.time() < deadline:
                    time.sleep(1)
                    left = [p for p in left if alive(p)]
            hung = bool(left)
        except subprocess.TimeoutExpired:
            left, hung = descendants(proc.pid) + [proc.pid], True
        if hung:  # every process of the run: its stacks (py-spy where installed), then gone
            stacks = []
            for pid in left:
                stacks.append(spy(pid))
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(2)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
    out = log.read_text()
    log.unlink()
    if hung:
        return "hang", "", out + "\n".join(stacks)
    m = re.search(r"^checksum (\S+ \S+)$", out, re.M)
    aborted = (proc.returncode < 0 or re.search(r"exitcode\s*:\s*-\d+", out)
               or "Fatal Python error" in out or "SIGABRT" in out or "Signal 6" in out)
    if aborted:
        return "abort", m.group(1) if m else "", out
    if proc.returncode != 0 or m is None:
        return "error", "", out
    return "ok", m.group(1), out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (by /proc's parent links)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def orphans(log: Path) -> list[int]:
    """Processes whose output goes to ``log`` (ranks a launcher left behind, re-parented)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "fd" / "1") == str(log.resolve()):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def spy(pid: int) -> str:
    """``py-spy dump --native`` of ``pid`` where py-spy is installed, else a note."""
    import shutil
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(exe):
        return f"(pid {pid}: no py-spy for a native stack; pip install py-spy)"
    r = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True,
                       text=True, timeout=60)
    return f"--- py-spy dump --native --pid {pid}\n{r.stdout}{r.stderr}"


def hog(n: int) -> list[subprocess.Popen]:
    """``n`` CPU-saturating processes, each ending by itself when this script is gone (its
    parent changes), however this script ends."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--example", choices=("ddp", "fsdp2", "single"), default="ddp")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--hog", type=int, default=1, help="CPU-saturating processes beside")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--logs", default="stress-logs")
    args = ap.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    hogs = hog(args.hog)
    counts = {"ok": 0, "abort": 0, "hang": 0, "error": 0, "differ": 0}
    first = None
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            for i, (verdict, checksum, out) in enumerate(
                    pool.map(lambda i: one(i, args), range(args.runs))):
                if verdict == "ok":
                    first = first or checksum
                    if checksum != first:
                        verdict = "differ"
                counts[verdict] += 1
                if verdict != "ok":
                    (logs / f"{args.example}-{i:03d}-{verdict}.log").write_text(out)
                print(f"run {i + 1}/{args.runs}: {verdict} "
                      f"({time.perf_counter() - t0:.0f} s; {counts})", flush=True)
    finally:
        for h in hogs:
            h.kill()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{args.example}: {args.runs} runs, {args.concurrency} at once, {args.hog} CPU "
          f"hog(s), {os.cpu_count()} CPUs (load {load:.1f} at the end): {counts}; "
          f"{time.perf_counter() - t0:.0f} s")
    return 0 if counts["ok"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
