"""docs/layout.md read from the tree: which source files it names (tests/test_native_layout.py,
tests/test_docs_layout.py). A file is named by its path from the repository root anywhere in the layout, or by its
file name on the line of its own folder in the layout's tree (the folder's entry, with the indented lines that
continue it)."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"
LAYOUT = REPO / "docs" / "layout.md"
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def native_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in CSRC.rglob("*") if p.is_file())


def folder_entries(text: str) -> dict[str, str]:
    """The layout tree's entries: folder path ("csrc/cpu/gemm/") -> its text, continuation lines included."""
    block = text.split("```", 2)[1]
    entries, folder = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, rest = line.partition(" ")
            entries[folder] = rest
        elif folder is not None:
            entries[folder] += " " + line.strip()
    return entries


def unnamed(files: list[str], text: str) -> list[str]:
    entries = folder_entries(text)
    missing = []
    for path in files:
        folder, _, name = path.rpartition("/")
        words = set(re.findall(r"[\w.*-]+", entries.get(folder + "/", "")))
        if path not in text and name not in words:
            missing.append(path)
    return missing
