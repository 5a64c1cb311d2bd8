"""What the suite requires of its environment, and the skips it accepts (the hooks are in tests/conftest.py).

A run fails, rather than skips, where a user would be hit: the native extension not importing, a dependency or
a library of pyproject.toml's `test` extra missing, at another version or failing to import, or a test skipped
for a reason that is not a fact of the machine (no CUDA GPU, a CPU without an ISA tier, a library version the
test names, the Triton interpreter imported in the wrong order, a platform without /proc or a compiler). Two
environment variables say a gap is meant: BERTFAST_NO_EXT=1 (as for `pip install`: the extension is not built)
and BERTFAST_ALLOW_MISSING=1 (a developer running a subset without the extras); .ci/run sets neither.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import os
import pathlib
import re

from packaging.requirements import Requirement

NO_EXT = os.environ.get("BERTFAST_NO_EXT") == "1"
ALLOW_MISSING = os.environ.get("BERTFAST_ALLOW_MISSING") == "1"
PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"

# The references the parity tests compare with: imported for real (a package can be installed and still fail to
# import); the other libraries of the extra only have to be found. FlagEmbedding's package __init__ does not import
# under transformers 5: its M3 embedder is imported as tests/test_bgem3.py imports it.
REFERENCES = ("transformers", "sentence_transformers", "FlagEmbedding", "peft")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """bertfast's dependencies and its `test` extra, as pyproject.toml lists them (the installed metadata's where
    there is no tomllib)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return [r for r in metadata.requires("bertfast") or []
                if "extra" not in r or re.search(r'extra\s*==\s*"test"', r)]
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    return project["dependencies"] + project["optional-dependencies"]["test"]


def _unmet(text: str, extra: str, seen: set) -> list[str]:
    """Why requirement `text` (of `extra`) is not met, its own extras' requirements included; [] when it is."""
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": extra}):
        return []
    if (_canonical(req.name), extra) in seen:
        return []
    seen.add((_canonical(req.name), extra))
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return [f"{req.name} is not installed (pyproject.toml asks {req})"]
    if not req.specifier.contains(version, prereleases=True):
        return [f"{req.name} {version} is installed; pyproject.toml asks {req}"]
    return [p for sub in sorted(req.extras) for r in metadata.requires(req.name) or [] for p in _unmet(r, sub, seen)]


def missing_requirements() -> list[str]:
    """Each dependency or library of the test extra that is not installed, at another version than pyproject.toml
    asks, or whose modules are not found."""
    modules: dict[str, list[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(_canonical(dist), []).append(module)
    problems, seen = [], set()
    for text in requirements():
        unmet = _unmet(text, "test", seen)
        problems += unmet
        req = Requirement(text)
        if unmet or (req.marker is not None and not req.marker.evaluate({"extra": "test"})):
            continue
        for module in sorted(m for m in modules.get(_canonical(req.name), []) if not m.startswith("_")):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError) as e:
                found, why = False, f"{type(e).__name__}: {e}"
            else:
                why = "no module found"
            if not found:
                problems.append(f"{req.name} is installed but its module {module} cannot be found ({why})")
    return problems


def reference_import_errors() -> list[str]:
    """The parity tests' references that do not import, each with its error."""
    problems = []
    for name in REFERENCES:
        try:
            if name == "FlagEmbedding":
                from helpers.bgem3 import flag_embedding_m3

                if flag_embedding_m3()[0] is None:
                    raise ImportError(flag_embedding_m3()[1])
            else:
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - whatever stops the import stops the parity tests
            problems.append(f"{name} does not import: {type(e).__name__}: {e}")
    return problems


# The skip reasons the suite accepts: facts of the machine, matched in this order; the first two only where the
# environment says the gap is meant.
_LIBRARIES = "transformers|sentence-transformers|PyLate|FlagEmbedding|PEFT|Triton|NumPy|torch|huggingface_hub|openai"
_VERSION = rf"\b({_LIBRARIES})\b.*\b\d+\.(\d+|x)\b"
SKIP_POLICY = (
    ("the native extension is not built (BERTFAST_NO_EXT=1)", NO_EXT,
     r"bertfast\._C|extension (is )?not built|native extension|backend 'cpu' (is )?unavailable|"
     r"cpu backend unavailable"),
    ("a library of the test extra is missing (BERTFAST_ALLOW_MISSING=1)", ALLOW_MISSING,
     r"could not import|not installed|is missing|not importable|does not import|needs the \w+ extra|"
     r"in the test extra"),
    ("a CUDA GPU, absent or present", True, r"needs a (CUDA )?GPU|without CUDA|CUDA is not available"),
    ("this CPU lacks an ISA tier", True,
     r"this CPU does not support the \S+ tier|needs a CPU with AVX-512|this CPU has no AVX-512 BF16|"
     r"the CPU has no (AVX-512 tier|AVX-VNNI)"),
    ("a library version named in the test", True, _VERSION),
    ("the Triton interpreter imported in the wrong order", True, r"TRITON_INTERPRET=1"),
    ("the platform lacks a tool or /proc file", True,
     r"Linux's /proc|/proc/self/clear_refs|x86-64 instructions|no C\+\+ compiler on PATH|needs binutils"),
)


def classify(reason: str) -> tuple[str, bool]:
    """(the policy's category of a skip reason, whether the suite accepts it)."""
    for category, allowed, pattern in SKIP_POLICY:
        if re.search(pattern, reason, flags=re.IGNORECASE):
            return category, allowed
    return "not an environment fact", False
