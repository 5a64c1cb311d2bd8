"""One owner of the ISA state: the extension parses BERTFAST_ISA and holds the tier; Python mirrors it, and the
libraries' caps are set by one explicit call (`bertfast.cap_libraries`), never by importing bertfast.

Each check runs in a child process started under the cap (the extension reads BERTFAST_ISA once, when it loads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from bertfast.backends.cpu import isa
from bertfast.backends.cpu.ext import _C

from conftest import supported_tiers

pytestmark = pytest.mark.skipif(not supported_tiers(), reason="bertfast._C is not built")

_LIBRARY_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")


def _child(code: str, cap: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("BERTFAST_ISA", "DNNL_MAX_CPU_ISA", *_LIBRARY_VARIABLES)}
    if cap is not None:
        env["BERTFAST_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_MIRROR = """
    import json, os, torch, bertfast
    from bertfast import _C
    from bertfast.backends.cpu import isa
    before = {k: os.environ.get(k) for k in %r}
    applied = bertfast.cap_libraries()
    torch.mm(torch.randn(64, 64), torch.randn(64, 64))
    parsed = _C.requested_cap() if hasattr(_C, "requested_cap") else None
    print(json.dumps({"before": before, "applied": applied, "requested": isa.requested_cap(), "parsed": parsed,
                      "environment": isa._environment_cap(), "tier": _C.isa(), "active_cap": isa.active_cap(),
                      "aten": torch.backends.cpu.get_cpu_capability()}))
""" % (_LIBRARY_VARIABLES,)


@pytest.mark.parametrize("cap", [*isa.CAPS, " avx2 "], ids=[*isa.CAPS, "avx2-blanks"])
def test_python_mirrors_the_extension(cap):
    """Under each cap the Python side reads the cap the extension parsed and the tier it runs; importing bertfast
    sets no library variable, and cap_libraries, called after it, sets the cap's own ones early enough for ATen."""
    child = _child(_MIRROR, cap)
    name = cap.strip()
    assert child["before"] == {k: None for k in _LIBRARY_VARIABLES}  # importing bertfast changed nothing
    assert child["requested"] == child["environment"] == name
    if child["parsed"] is not None:  # the extension's parse, where `_C` exports it
        assert child["parsed"] == name
    assert child["applied"] == isa.library_caps(name)
    if isa.unsupported(name) is None:  # the extension runs the cap, and Python names it so
        assert child["tier"] == isa.cap_tier(name)
        assert child["active_cap"] == (name if name != "avx512_vnni" or "avx512_bf16" in isa.proc_cpuinfo()[1]
                                       else isa.NO_BF16)
    aten = child["applied"].get("ATEN_CPU_CAPABILITY")
    if aten is not None and isa.unsupported(name) is None:  # ATen read the variable set after `import bertfast`
        assert child["aten"].lower() == aten


def test_no_cap_sets_nothing():
    child = _child(_MIRROR, None)
    assert child["requested"] is None and child["applied"] == {} and child["parsed"] in (None, "")
    assert child["tier"] == _C.detected_isa()


def test_the_command_line_caps_the_libraries():
    """`python -m bertfast` (`tools.cli.main`) calls cap_libraries before any command runs."""
    child = _child("""
        import contextlib, io, json, os
        from bertfast.tools.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["--help"])
        print(json.dumps({k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}))
    """, "avx2")
    assert child == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_user_settings_win(monkeypatch):
    """A variable the user set stays as it is; cap_libraries sets the cap's others and records them (APPLIED: what a
    child process under another cap must not inherit)."""
    for name in _LIBRARY_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that what cap_libraries sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(isa, "APPLIED", {})
    applied = isa.cap_libraries("portable")
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and "ONEDNN_MAX_CPU_ISA" not in applied
    assert applied == {k: v for k, v in isa.library_caps("portable").items() if k != "ONEDNN_MAX_CPU_ISA"}
    assert isa.APPLIED == applied and isa.cap_libraries("portable") == {}  # set already: nothing more
    with pytest.raises(ValueError, match="'sse9' is not an ISA cap"):
        isa.cap_libraries("sse9")


_EXPECTED = f"BERTFAST_ISA='sse9' is not an ISA tier; expected one of {', '.join(isa.CAPS)}"


def test_unknown_name_is_refused(monkeypatch):
    """An unknown name fails `import bertfast`, with one message from either reading: the extension's parse and the
    Python one (a process without the extension)."""
    env = {k: v for k, v in os.environ.items() if k != "BERTFAST_ISA"}
    out = subprocess.run([sys.executable, "-c", "import bertfast"], env={**env, "BERTFAST_ISA": "sse9"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and _EXPECTED in out.stderr, out.stderr[-2000:]
    monkeypatch.setenv("BERTFAST_ISA", "sse9")
    with pytest.raises(ValueError) as raised:
        isa._environment_cap()
    assert str(raised.value) == _EXPECTED
    if hasattr(_C, "requested_cap"):  # the extension's own message, from _C loaded alone (bertfast would raise)
        code = """
            import importlib.util, sys, torch
            spec = importlib.util.spec_from_file_location("bertfast._C", sys.argv[1])
            ext = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(ext)
            try:
                ext.requested_cap()
            except ValueError as e:
                print(e)
        """
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), _C.__file__],
                             env={**env, "BERTFAST_ISA": "sse9"}, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == _EXPECTED, out.stderr[-2000:]


def test_tier_names_agree():
    """Python's tier names are the extension's: it knows each one, and the one cap that is no tier is not one."""
    for tier in isa.TIERS:
        assert _C.isa_supported(tier) in (True, False)  # ValueError for a name the extension does not know
    with pytest.raises(ValueError):
        _C.isa_supported(isa.NO_BF16)
