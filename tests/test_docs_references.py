"""References in the docs and in code comments point at things that exist: a moved file, a renamed symbol or a
dropped flag fails here, not in a reader's hands.

Scanned: README.md, docs/*.md, benchmarks/README.md, and the comments and docstrings of bertfast/, csrc/,
benchmarks/ and tests/. Checked: (a) repository paths (`csrc/cpu/layer/layer.cpp`, `docs/int8.md#scheme`,
`tests/test_tiers.py::test_batch_invariance`, globs such as `csrc/cpu/int8/int8_linear*.cpp`) exist, with their
anchor or test; a name with neither an extension nor a trailing slash is read as words ("fp32/bf16"), not a
path; (b) `bertfast.` dotted names resolve by import and getattr; (c) `bertfast <command> ... --flag` names a
flag the command's parser defines (parsers built from `bertfast.tools.cli.COMMANDS`); (d) Markdown links
relative to their file reach a file and heading. In Markdown, commands are read only inside code (spans and
fenced blocks), so prose is never parsed as a command line.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import io
import pathlib
import re
import tokenize
from dataclasses import dataclass

import pytest

from bertfast.tools.cli import COMMANDS

REPO = pathlib.Path(__file__).resolve().parents[1]

# Names that look like references but are not ones to this tree, each with its reason.
ALLOWED = {
    "bertfast/backends/gemm_table.json": "written by `bertfast gpucheck --stages gemm` on a GPU and read by "
                                         "backends/gemm_choice.py when present; none is committed yet",
    "bertfast.serve.access": "a logging logger's name (tools/serve/gate.py), not a module",
}

TOP_DIRS = ("bertfast", "csrc", "docs", "benchmarks", "tests")
_PATH = re.compile(r"(?<![\w./\-])((?:%s)/[\w.*/\-]*[\w*/])(?:(#[\w\-]+)|::(\w+))?" % "|".join(TOP_DIRS))
_SYMBOL = re.compile(r"(?<![\w./\-])bertfast((?:\.[A-Za-z_]\w*)+)")
_COMMAND = re.compile(r"(?<![\w./\-])bertfast\s+(%s)\b" % "|".join(COMMANDS))
_FLAG = re.compile(r"(?<![\w\-])(--[a-z][\w\-]*)")
_LINK = re.compile(r"\]\((?!https?:|mailto:)([^)#\s]*)(#[\w\-]+)?\)")  # a Markdown link, relative to its file
_CMD_END = re.compile(r"\s#|\||;|&&|`")  # the end of one command line inside a longer text


@dataclass(frozen=True)
class Problem:
    where: str  # file:line
    kind: str  # path, symbol, flag, link
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.kind} {self.text!r}: {self.why}"


@dataclass(frozen=True)
class Chunk:
    """A piece of text to scan and where it starts; `code` says commands may be read in it, `refs` that its
    paths and symbols are checked (a Markdown file's are checked once, in its whole text)."""

    file: str
    line: int
    text: str
    code: bool
    refs: bool = True


# --- what to scan --------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # inline code, possibly wrapped over lines of one paragraph


def markdown_chunks(name: str, text: str) -> list[Chunk]:
    """The whole file as prose (paths, symbols) plus each fenced block's lines and inline span as code."""
    chunks = [Chunk(name, 1, text, False)]
    fenced = []
    for m in _FENCE.finditer(text):
        start = text.count("\n", 0, m.start()) + 1
        fenced.append((m.start(), m.end()))
        for i, line in enumerate(m.group(0).splitlines()):
            chunks.append(Chunk(name, start + i, line, True, refs=False))
    for m in _SPAN.finditer(text):
        if not any(a <= m.start() < b for a, b in fenced):
            chunks.append(Chunk(name, text.count("\n", 0, m.start()) + 1, m.group(1), True, refs=False))
    return chunks


def python_chunks(name: str, text: str) -> list[Chunk]:
    """Comments and docstrings of a Python file."""
    chunks = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            chunks.append(Chunk(name, tok.start[0], tok.string, True))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                chunks.append(Chunk(name, body[0].lineno, body[0].value.value, True))
    return chunks


_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def cpp_chunks(name: str, text: str) -> list[Chunk]:
    return [Chunk(name, text.count("\n", 0, m.start()) + 1, m.group(0), True) for m in _CPP_COMMENT.finditer(text)]


def shell_chunks(name: str, text: str) -> list[Chunk]:
    return [Chunk(name, i + 1, line[line.index("#"):], True)
            for i, line in enumerate(text.splitlines()) if "#" in line]


def tree_chunks() -> list[Chunk]:
    files = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for top in ("bertfast", "csrc", "benchmarks", "tests"):
        files += sorted(p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".cpp", ".h", ".sh"))
    chunks = []
    for path in files:
        name, text = str(path.relative_to(REPO)), path.read_text()
        if path.suffix == ".md":
            chunks += markdown_chunks(name, text)
        elif path.suffix == ".py":
            chunks += python_chunks(name, text)
        elif path.suffix == ".sh":
            chunks += shell_chunks(name, text)
        else:
            chunks += cpp_chunks(name, text)
    return chunks


# --- the checks ----------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def check_path(root: pathlib.Path, path: str, anchor: str | None, test: str | None) -> str | None:
    if path in ALLOWED:
        return None
    hits = list(root.glob(path.rstrip("/"))) if "*" in path else [root / path] if (root / path).exists() else []
    if not hits:
        return "no such file or directory"
    if anchor:
        headings = re.findall(r"^#+\s+(.*)$", hits[0].read_text(), re.M)
        if anchor[1:] not in {_slug(h) for h in headings}:
            return f"no heading with anchor {anchor}"
    if test and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{test}\b", hits[0].read_text(), re.M):
        return f"no test or class {test}"
    return None


def check_symbol(dotted: str) -> str | None:
    """Import the longest module prefix of `dotted`, then getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(name) is None:
                continue
        except (ImportError, ValueError):
            continue
        obj = importlib.import_module(name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return f"{name} has no attribute {attr}" if obj.__name__ == name else f"no attribute {attr}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for name, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"bertfast {name}")
        importlib.import_module(module).add_arguments(parser)
        parsers[name] = parser
    return parsers


def command_flags(text: str) -> list[tuple[str, str]]:
    """(command, flag) for each `--flag` written after `bertfast <command>` on the same command line."""
    found = []
    for m in _COMMAND.finditer(text):
        rest = text[m.end():]
        end = _CMD_END.search(rest)
        rest = rest[:end.start()] if end else rest
        rest = rest.split("\n")[0] if not rest.rstrip("\n").endswith("\\") else rest
        nxt = _COMMAND.search(rest)
        rest = rest[:nxt.start()] if nxt else rest
        found += [(m.group(1), f) for f in _FLAG.findall(rest)]
    return found


def scan(chunks: list[Chunk], root: pathlib.Path = REPO, parsers=None) -> tuple[list[Problem], int]:
    """Every stale reference in `chunks`, and how many references were checked."""
    parsers = parsers if parsers is not None else command_parsers()
    problems, seen, count = [], {}, 0

    def once(key, check):
        if key not in seen:
            seen[key] = check()
        return seen[key]

    def at(c: Chunk, m: re.Match) -> str:
        return f"{c.file}:{c.line + c.text.count(chr(10), 0, m.start())}"

    for c in chunks:
        if c.file.endswith(".md") and not c.code:
            for m in _LINK.finditer(c.text):
                count += 1
                target = (root / c.file).parent / m.group(1) if m.group(1) else root / c.file
                why = once(("link", str(target), m.group(2)),
                           lambda: check_path(target.parent, target.name, m.group(2), None))
                if why:
                    problems.append(Problem(at(c, m), "link",
                                            m.group(0), why))
        for m in _PATH.finditer(c.text if c.refs else ""):
            last = m.group(1).rsplit("/", 1)[-1]
            if last and "." not in last and "*" not in last and not m.group(2) and not m.group(3):
                continue  # no extension, no trailing slash: words with slashes ("tests/failures/errors")
            count += 1
            why = once(("path",) + m.groups(), lambda: check_path(root, *m.groups()))
            if why:
                problems.append(Problem(at(c, m), "path",
                                        m.group(0), why))
        for m in _SYMBOL.finditer(c.text if c.refs else ""):
            dotted = "bertfast" + m.group(1)
            if c.text[m.end():m.end() + 1] == "/" or dotted.endswith((".py", ".md", ".json")):
                continue  # a file name such as bertfast.json, not a symbol
            count += 1
            if dotted in ALLOWED:
                continue
            why = once(("symbol", dotted), lambda: check_symbol(dotted))
            if why:
                problems.append(Problem(at(c, m), "symbol",
                                        dotted, why))
        if c.code:
            for command, flag in command_flags(c.text):
                count += 1
                if flag not in parsers[command]._option_string_actions:
                    problems.append(Problem(f"{c.file}:{c.line}", "flag", f"bertfast {command} {flag}",
                                            f"`bertfast {command}` has no option {flag}"))
    return problems, count


# --- tests ---------------------------------------------------------------------------------------------------

def test_no_stale_references():
    problems, count = scan(tree_chunks())
    assert count > 500, f"only {count} references found: the scanner no longer sees the docs"
    assert not problems, f"{len(problems)} stale references:\n" + "\n".join(map(str, problems))


def test_allow_list_entries_do_not_exist():
    """An allowed name that now exists (or no longer appears anywhere) should leave the list."""
    for name in ALLOWED:
        if name.startswith("bertfast."):
            assert check_symbol(name), f"{name} resolves now: drop it from ALLOWED"
        else:
            assert not (REPO / name).exists(), f"{name} exists: drop it from ALLOWED"


def test_scanner_finds_each_kind(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real heading\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_real():\n    pass\n")
    text = (
        "See docs/real.md#real-heading and docs/real.md#missing, docs/gone.md, tests/test_x.py::test_real,\n"
        "tests/test_x.py::test_gone and tests/*.py.\n"
        "`bertfast.cpu_info()` and `bertfast.no_such_thing` and `bertfast.tools.cli.COMMANDS`.\n"
        "```bash\npython -m bertfast bench --quick --no-such-flag   # --also-not-checked in a comment\n```\n"
        "`bertfast embed in out/ --resume --no-progress` and `bertfast serve --port 1 --nope`\n"
        "# Links\n[ok](docs/real.md#real-heading), [ok](#links), [bad](docs/nope.md), [bad](#nowhere)\n"
    )
    (tmp_path / "fake.md").write_text(text)
    problems, count = scan(markdown_chunks("fake.md", text), root=tmp_path)
    got = sorted((p.kind, p.text) for p in problems)
    assert got == [
        ("flag", "bertfast bench --no-such-flag"),
        ("flag", "bertfast serve --nope"),
        ("link", "](#nowhere)"),
        ("link", "](docs/nope.md)"),
        ("path", "docs/gone.md"),
        ("path", "docs/nope.md"),
        ("path", "docs/real.md#missing"),
        ("path", "tests/test_x.py::test_gone"),
        ("symbol", "bertfast.no_such_thing"),
    ], got
    assert count == 8 + 3 + 6 + 4  # paths, symbols, flags, links


def test_code_comments_are_scanned():
    py = '"""Docstring citing bertfast/quant.py."""\nx = "bertfast/not_a_comment.py"  # see csrc/nope.cpp\n'
    cpp = "int x; // bertfast.backends.cpu.nope\n/* python -m bertfast demo --nope */\n"
    problems, _ = scan(python_chunks("a.py", py) + cpp_chunks("b.cpp", cpp))
    assert sorted(p.text for p in problems) == [
        "bertfast demo --nope", "bertfast.backends.cpu.nope", "bertfast/quant.py", "csrc/nope.cpp"]
    assert {p.where for p in problems} == {"a.py:1", "a.py:2", "b.cpp:1", "b.cpp:2"}


@pytest.mark.parametrize("text, flags", [
    ("python -m bertfast bench --isa all --json F  # --ignored", [("bench", "--isa"), ("bench", "--json")]),
    ("bertfast embed a b --resume | head --lines 3", [("embed", "--resume")]),
    ("bertfast demo --model M; bertfast serve --port 1", [("demo", "--model"), ("serve", "--port")]),
    ("the bertfast bench command", []),
], ids=["comment", "pipe", "two-commands", "no-flags"])
def test_command_flags(text, flags):
    assert command_flags(text) == flags
