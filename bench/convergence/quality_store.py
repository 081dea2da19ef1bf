"""Distil the convergence study's rows into the tuner's real-model quality store.

Reads ``study.py`` JSON files (default: every file of :data:`SOURCES` that exists), pairs each
ZenFlow row with AdamW's row of the same workload, learning rate and seed, and writes
``autotune/data/real_quality.json`` (:mod:`autotune.realquality`): per setting class (the
settings of ``train.OPTIMIZERS`` that change the arithmetic) and per workload (a workload at
a learning rate other than its own is its own entry, ``name@lr``), the seeds, the mean final
held-out loss minus AdamW's and the mean accuracy minus AdamW's (points). Only pairs with
AdamW on the same seed count; a setting class enters with what it has (the tuner's verdict
asks for 2 seeds on every core workload). Rows of the same workload, lr, optimizer and seed
in two files: the first file wins.

    python bench/convergence/quality_store.py            # rewrite the shipped store
    python bench/convergence/quality_store.py --check    # exit 1 if it would change

Provenance: the date, this checkout's commit, the command, and each source file with the
commit that last wrote it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from train import OPTIMIZERS, WARMUP_AS_LR, as_run  # noqa: E402
from study import WORKLOADS, _lr  # noqa: E402  (a row's lr, the study's own rule)

from autotune.realquality import FORMAT, STORE_PATH, setting_key  # noqa: E402

SOURCES = ("convergence.json", "widened.json", "lr_sweep.json", "lr_sweep_2e5.json",
           "widened2.json", "short_windows.json", "desktop_24gb.json")
CORE = ("smollm2", "smollm2-bbc", "minilm", "minilm-rt", "minilm-tweets")
"""The workloads every setting class of the store is asked to have (2 seeds each)."""
DESCRIBE = {
    "smollm2": ("SmolLM2-135M-Instruct", "lm", "causal LM on Python's docs (pydoc_data)"),
    "smollm2-bbc": ("SmolLM2-135M-Instruct", "lm", "causal LM on BBC News articles"),
    "gemma3": ("Gemma 3 270M", "lm", "causal LM on Python's docs (pydoc_data)"),
    "minilm": ("all-MiniLM-L6-v2", "classification", "BBC News topics, 5 classes"),
    "minilm-rt": ("all-MiniLM-L6-v2", "classification", "Rotten Tomatoes sentiment, 2 classes"),
    "minilm-tweets": ("all-MiniLM-L6-v2", "classification",
                      "crowd-labelled tweets, 3 classes, linear decay"),
    "minilm3-tweets": ("all-MiniLM-L6-v2, first 3 layers + new pooler", "classification",
                       "crowd-labelled tweets, 3 classes, linear decay"),
    "minilm3-bbc": ("all-MiniLM-L6-v2, first 3 layers + new pooler", "classification",
                    "BBC News topics, 5 classes, linear decay"),
    "mpnet-tweets": ("all-mpnet-base-v2 (12 layers)", "classification",
                     "crowd-labelled tweets, 3 classes, linear decay"),
}
SKIPPED = {"adamw", "zero-offload", "adamw-fused", "zenflow-adaptive-dense-fresh64"}
"""The reference, a peer, AdamW through another kernel (a noise floor), and a schedule the
study script switches mid-run: not settings the tuner may pick."""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _workload_id(row: dict) -> str:
    own = WORKLOADS[row["workload"]][0]
    lr = _lr(row)
    return row["workload"] if lr == own else f"{row['workload']}@{lr:g}"


def read_rows(files: list[Path]) -> list[dict]:
    seen, rows = set(), []
    for f in files:
        for r in json.loads(f.read_text(encoding="utf-8")):
            key = (r["workload"], _lr(r), r["optimizer"], r["seed"])
            if key not in seen and (r.get("diverged") or r.get("final")):
                seen.add(key)
                rows.append(r)
    return rows


def build(files: list[Path]) -> dict:
    rows = read_rows(files)
    ref = {(_workload_id(r), r["seed"]): r["final"] for r in rows
           if r["optimizer"] == "adamw" and not r.get("diverged")}
    entries: dict[str, dict] = {}
    workloads: dict[str, dict] = {}
    seeds_all: set[int] = set()
    for name, kw in OPTIMIZERS.items():
        if name in SKIPPED or kw is None or kw.get("warmup_steps") == WARMUP_AS_LR:
            continue
        mine = [r for r in rows if r["optimizer"] == name]
        by_wl: dict[str, list[dict]] = {}
        for r in mine:
            if (_workload_id(r), r["seed"]) in ref:
                by_wl.setdefault(_workload_id(r), []).append(r)
        if not by_wl:
            continue
        results = {}
        for wl, rs in sorted(by_wl.items()):
            rs.sort(key=lambda r: r["seed"])
            plain = rs[0]["workload"]
            if plain not in DESCRIBE:
                raise SystemExit(f"workload {plain!r} has rows but no description in DESCRIBE "
                                 "(model, kind, task): add one")
            model, kind, task = DESCRIBE[plain]
            workloads[wl] = {"model": model, "kind": kind, "task": task, "lr": _lr(rs[0]),
                             "steps": rs[0].get("steps")}
            diverged = sum(bool(r.get("diverged")) for r in rs)
            if diverged:  # a divergence fails the setting on this workload, never hides
                results[wl] = {"seeds": [r["seed"] for r in rs], "diverged": diverged,
                               "loss_delta": None}
                seeds_all.update(results[wl]["seeds"])
                continue
            base = [ref[(wl, r["seed"])] for r in rs]
            loss = statistics.mean(r["final"]["loss"] - b["loss"] for r, b in zip(rs, base))
            res = {"seeds": [r["seed"] for r in rs], "loss_delta": round(loss, 6)}
            if all(r["final"].get("accuracy") is not None for r in rs):
                acc = statistics.mean(r["final"]["accuracy"] - b["accuracy"]
                                      for r, b in zip(rs, base))
                res["accuracy_delta_pts"] = round(100 * acc, 3)
            results[wl] = res
            seeds_all.update(res["seeds"])
        # as the rows ran (fresh_if_spread off unless the setting turns it on)
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in as_run(kw).items()}
        key = setting_key(settings)
        if key in entries:  # two names for one arithmetic: keep the one with more rows
            def rows_of(res: dict) -> int:
                return sum(len(r["seeds"]) for r in res.values())
            if rows_of(entries[key]["results"]) >= rows_of(results):
                continue
        entries[key] = {"name": name, "settings": settings, "results": results}
    return {
        "format": FORMAT,
        "provenance": {
            "date": _dt.date.today().isoformat(),
            "commit": _git("rev-parse", "HEAD"),
            "command": "python bench/convergence/quality_store.py",
            "rows_from": "python bench/convergence/study.py --workloads W --optimizers O "
                         "--seeds S --threads 1 --json F (docs/quality.md gives each one)",
            "sources": [{"file": str(f.relative_to(ROOT)),
                         "last_written_at": _git("log", "-1", "--format=%H", "--", str(f))}
                        for f in files],
            "seeds": sorted(seeds_all),
            "recipe": "bench/convergence/train.py: warm-up over the first 10% of the steps, "
                      "clipping at 1.0, weight decay 0.01; final held-out loss (and accuracy) "
                      "after opt.eval()",
            "lr_rule": "rows written before commit a4d6a2d (2026-12-06) ran with a window's "
                       "host step at the lr of the step that closed it; since, at the mean of "
                       "its steps' lrs. The two differ only for windows in the lr warm-up and "
                       "decay (docs/quality.md, 'The window's learning rate')",
        },
        "core": list(CORE),
        "workloads": dict(sorted(workloads.items())),
        "entries": sorted(entries.values(), key=lambda e: e["name"]),
    }


def _comparable(doc: dict) -> dict:
    out = dict(doc)
    out["provenance"] = {k: v for k, v in doc["provenance"].items()
                         if k not in ("date", "commit", "sources")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="study JSON files (default: the shipped sources)")
    ap.add_argument("--out", default=str(STORE_PATH))
    ap.add_argument("--check", action="store_true",
                    help="compare with --out (dates and commits aside); exit 1 if it differs")
    args = ap.parse_args(argv)
    files = ([Path(f).resolve() for f in args.files] if args.files else
             [HERE / "data" / s for s in SOURCES if (HERE / "data" / s).exists()])
    doc = build(files)
    out = Path(args.out)
    if args.check:
        old = json.loads(out.read_text(encoding="utf-8"))
        same = _comparable(old) == _comparable(json.loads(json.dumps(doc)))
        print(f"{out}: {'up to date' if same else 'differs from the study rows'}")
        return 0 if same else 1
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(doc['entries'])} setting classes, {len(doc['workloads'])} "
          f"workloads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
