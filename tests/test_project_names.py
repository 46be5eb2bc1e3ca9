"""The project names its experiments by date and by what was tried, and its benchmarks write
where ``--out`` says: no record, comment or string names an experiment by a running counter
(the word for a sitting followed by a number, or preceded by an ordinal), and no script
takes its output directory from an ``OUT`` environment variable."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", ".venv-sglang", "__pycache__", "outputs", "runs", "build", "dist", ".hypothesis", ".pytest_cache",
             ".anchor", ".scratch", ".whl", ".gl", ".sglang-gpu"}  # local, git-ignored: third-party builds, scratch files
SUFFIXES = {".py", ".md", ".json", ".txt", ".sh", ".toml"}

# patterns are assembled from pieces so that this file does not match them itself
WORD = "sess" + "ion"
COUNTER_NAMES = re.compile(
    rf"{WORD}s?[ _-]?\d"  # the word, then a number: joined, by '_', '-' or a space, or plural
    rf"|\b(first|second|third|fourth|fifth|sixth|\d+(st|nd|rd|th))\s+{WORD}\b",  # an ordinal, then the word
    re.IGNORECASE)
OUT_ENV = re.compile("|".join(re.escape(s) for s in (
    "environ.get(" + '"OUT"', "environ.get(" + "'OUT'", "environ[" + '"OUT"', "environ[" + "'OUT'",
    "getenv(" + '"OUT"', "getenv(" + "'OUT'")) + "|" + re.escape("$") + r"OUT\b|\$\{OUT\}")


def _project_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix in SUFFIXES:
                yield path


def _hits(pattern: re.Pattern) -> list[str]:
    found = []
    for path in _project_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {text[max(0, m.start() - 40):m.end() + 40]!r}")
    return found


def test_scan_sees_the_project():
    names = {p.relative_to(ROOT).as_posix() for p in _project_files()}
    assert {"README.md", "benchmarks/common.py", "benchmarks/results/lru_diff.json", "sparsehi/cli.py"} <= names


def test_patterns_catch_what_they_forbid():
    for text in (WORD + "2_experiments", WORD + " 3", WORD + "-3", WORD + "s 1-2", "Fourth " + WORD):
        assert COUNTER_NAMES.search(text), text
    for text in ("os.environ.get(" + '"OUT"' + ")", "under " + "$" + "OUT", "os.getenv(" + "'OUT'" + ")"):
        assert OUT_ENV.search(text), text
    for text in ("same H200 machine and day", "2026-11-23_order_array_kernel_variants", "--out DIR", "OUTPUT"):
        assert not COUNTER_NAMES.search(text) and not OUT_ENV.search(text), text


def test_no_experiment_is_named_by_a_counter():
    hits = _hits(COUNTER_NAMES)
    assert not hits, "name experiments by date and by what was tried:\n" + "\n".join(hits)


def test_no_output_directory_from_an_environment_variable():
    hits = _hits(OUT_ENV)
    assert not hits, "results go where --out says (default benchmarks/results):\n" + "\n".join(hits)
