"""The suite's own checks of its environment (tests/helpers/environment.py, run by tests/conftest.py's hooks): which
skip reasons it accepts, and what it reports of the test extra's requirements."""

from __future__ import annotations

import pytest

from helpers import environment

ACCEPTED = [  # the suite's own reasons, one per fact of the machine
    ("needs a CUDA GPU (torch.cuda.is_available())", "a CUDA GPU, absent or present"),
    ("checks the behaviour without CUDA", "a CUDA GPU, absent or present"),
    ("this CPU does not support the amx tier (its best: avx512_vnni)", "this CPU lacks an ISA tier"),
    ("amx_emulated needs a CPU with AVX-512 VNNI (the AMX kernels' code around the tiles)",
     "this CPU lacks an ISA tier"),
    ("this CPU has no AVX-512 BF16 to hide: its avx512_vnni tier is this cap already", "this CPU lacks an ISA tier"),
    ("the CPU has no AVX-VNNI (avx_vnni in /proc/cpuinfo)", "this CPU lacks an ISA tier"),
    ("transformers 5.16.0 has no GteModel", "a library version named in the test"),
    ("this Triton's interpreter sets its patches for good (3.4 and earlier): no scoped form",
     "a library version named in the test"),
    ("PyLate pins sentence-transformers 5.3.0 and this environment has sentence-transformers 6.3.0 (the test extra "
     "asks >= 6.2): no pylate here", "a library version named in the test"),
    ("bertfast.kernels.triton was imported before TRITON_INTERPRET=1 was set in this process",
     "the Triton interpreter imported in the wrong order"),
    ("reads the peak RSS from Linux's /proc/self/status", "the platform lacks a tool or /proc file"),
    ("no C++ compiler on PATH", "the platform lacks a tool or /proc file"),
]
GATED = [  # accepted only where the environment says the gap is meant
    ("the native extension bertfast._C is not built (run bash install.sh)", "BERTFAST_NO_EXT=1"),
    ("backend 'cpu' unavailable: native extension not built: run bash install.sh", "BERTFAST_NO_EXT=1"),
    ("could not import 'bertfast._C': No module named 'bertfast._C'", "BERTFAST_NO_EXT=1"),
    ("could not import 'transformers': No module named 'transformers'", "BERTFAST_ALLOW_MISSING=1"),
    ("bertfast serve needs the serve extra (fastapi): pip install 'bertfast[serve]'", "BERTFAST_ALLOW_MISSING=1"),
]
REFUSED = ["flaky, skip for now", "the int16 products run on avx512_vnni without AVX-512 BF16, not on avx2",
           "not implemented yet", "too slow"]


@pytest.mark.parametrize("reason, category", ACCEPTED, ids=[c for _, c in ACCEPTED])
def test_environment_facts_are_accepted(reason, category):
    assert environment.classify(reason) == (category, True)


@pytest.mark.parametrize("reason, variable", GATED, ids=[v for _, v in GATED])
def test_gaps_are_accepted_only_where_the_environment_says_so(reason, variable):
    category, accepted = environment.classify(reason)
    assert variable in category
    flag = environment.NO_EXT if variable == "BERTFAST_NO_EXT=1" else environment.ALLOW_MISSING
    assert accepted == flag


@pytest.mark.parametrize("reason", REFUSED)
def test_other_reasons_are_refused(reason):
    assert environment.classify(reason) == ("not an environment fact", False)


def test_requirements_name_what_is_wrong():
    """A requirement met gives nothing; one at another version or not installed names the package and pyproject.toml's
    requirement; a requirement for another platform or extra is not checked."""
    assert environment._unmet("pytest>=7", "test", set()) == []
    assert environment._unmet("pytest<1", "test", set()) == [
        f"pytest {pytest.__version__} is installed; pyproject.toml asks pytest<1"]
    assert environment._unmet("no-such-package-b57>=1", "test", set()) == [
        "no-such-package-b57 is not installed (pyproject.toml asks no-such-package-b57>=1)"]
    assert environment._unmet("no-such-package-b57; sys_platform == 'nonexistent'", "test", set()) == []
    assert environment._unmet("no-such-package-b57; extra == 'other'", "test", set()) == []
    assert "pytest>=7" in environment.requirements() and "torch>=2.4" in environment.requirements()
