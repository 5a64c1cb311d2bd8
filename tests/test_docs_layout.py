"""The docs keep the current truth in few lines, and docs/layout.md names every source file: every file under csrc/
and every module under bertfast/ (by its path anywhere in the page, or by its file name or module name on its
folder's line of the layout's tree), and every docs/*.md is at most 250 lines (history goes to
benchmarks/results/<date or topic>/README.md).
"""

from __future__ import annotations

import pathlib
import re

from helpers.layout import LAYOUT, REPO, folder_entries, native_files, unnamed

MAX_DOC_LINES = 250


def python_modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "bertfast").rglob("*.py") if "__pycache__" not in p.parts)


def unnamed_sources(files: list[str], text: str) -> list[str]:
    """`unnamed` (a path, or a file name on its folder's line), and a .py module also named by its stem ("encoder")."""
    entries = folder_entries(text)
    missing = []
    for path in unnamed(files, text):
        folder, _, name = path.rpartition("/")
        words = set(re.findall(r"[\w.*-]+", entries.get(folder + "/", "")))
        if not (name.endswith(".py") and name[:-3] in words):
            missing.append(path)
    return missing


def long_docs(root: pathlib.Path) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for p in sorted((root / "docs").glob("*.md"))
            if (n := len(p.read_text().splitlines())) > MAX_DOC_LINES]


def test_every_source_file_is_named_in_layout():
    missing = unnamed_sources(native_files() + python_modules(), LAYOUT.read_text())
    assert not missing, "source files that docs/layout.md does not name (by path, or by name on its folder's line): " \
        + ", ".join(missing)


def test_docs_are_short():
    too_long = long_docs(REPO)
    assert not too_long, f"docs over {MAX_DOC_LINES} lines (move run logs to benchmarks/results/): " + "; ".join(too_long)


def test_unnamed_sources_are_reported():
    text = ("```\nbertfast/        __init__, encoder (Encoder), reference.py\nbertfast/tools/  cli,\n"
            "                 demo\ncsrc/cpu/gemm/   linear.cpp\n```\n")
    files = ["bertfast/__init__.py", "bertfast/encoder.py", "bertfast/reference.py", "bertfast/engine.py",
             "bertfast/tools/cli.py", "bertfast/tools/demo.py", "bertfast/tools/aot.py", "bertfast/tools/encoder.py",
             "csrc/cpu/gemm/linear.cpp", "csrc/cpu/gemm/linear"]
    assert unnamed_sources(files, text) == ["bertfast/engine.py", "bertfast/tools/aot.py", "bertfast/tools/encoder.py",
                                            "csrc/cpu/gemm/linear"]


def test_long_docs_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "short.md").write_text("# Short\n" * MAX_DOC_LINES)
    (tmp_path / "docs" / "long.md").write_text("# Long\n" * (MAX_DOC_LINES + 1))
    assert long_docs(tmp_path) == [f"docs/long.md: {MAX_DOC_LINES + 1} lines"]
