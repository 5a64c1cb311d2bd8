"""The native sources' layout, read from the tree: every file under csrc/ is named in docs/layout.md, and no
.cpp includes another .cpp (setup.py compiles each source on its own; the amx_emulated tier's second build of the
AMX kernels is a compile flag, not a wrapper file).

A file is named by its path from the repository root anywhere in docs/layout.md, or by its file name on the line
of its own folder in the layout's tree (the folder's entry, with the indented lines that continue it).
"""

from __future__ import annotations

import re

from helpers.layout import _INCLUDE, CSRC, LAYOUT, REPO, native_files, unnamed


def test_every_native_file_is_named_in_layout():
    missing = unnamed(native_files(), LAYOUT.read_text())
    assert not missing, "files under csrc/ that docs/layout.md does not name (by path, or on its folder's line): " \
        + ", ".join(missing)


def test_unnamed_files_are_reported():
    text = "```\ncsrc/cpu/gemm/   the GEMM: linear.cpp,\n                 linear_impl.h\n```\n"
    files = ["csrc/cpu/gemm/linear.cpp", "csrc/cpu/gemm/linear_impl.h", "csrc/cpu/gemm/linear_amx.cpp",
             "csrc/cpu/int8/linear.cpp"]
    assert unnamed(files, text) == ["csrc/cpu/gemm/linear_amx.cpp", "csrc/cpu/int8/linear.cpp"]


def test_no_cpp_includes_a_cpp():
    found = [f"{p.relative_to(REPO)}: #include {inc}" for p in sorted(CSRC.rglob("*.cpp"))
             for inc in _INCLUDE.findall(p.read_text()) if inc.endswith((".cpp", ".cc", ".c"))]
    assert not found, "a .cpp that includes a .cpp (compile it on its own, with flags in setup.py): " + "; ".join(found)


def test_includes_are_written_from_csrc():
    """Every project include names its file from csrc/ (include_dirs=[csrc]), so it reads the same in any folder."""
    wrong = [f"{p.relative_to(REPO)}: {inc}" for p in sorted(CSRC.rglob("*")) if p.suffix in (".cpp", ".h")
             for inc in re.findall(r'^\s*#\s*include\s*"([^"]+)"', p.read_text(), re.M)
             if not (CSRC / inc).is_file()]
    assert not wrong, "includes not found under csrc/: " + "; ".join(wrong)
