"""CPU ISA tiers: which one the native kernels run, and the same cap for oneDNN, MKL and ATen (`cap_libraries`).

Tiers, lowest to highest: `portable` (plain loops), `avx2` (AVX2 + FMA), `avx512_vnni` (AVX-512 F/BW/VL/DQ
+ VNNI, AVX-512 BF16 where present), `amx_emulated` (the amx tier's kernels with the tile instructions
emulated: slow, for testing the AMX code on a CPU with AVX-512 VNNI but no AMX; docs/tiers.md),
`amx` (AMX bf16/int8 tiles). The extension picks the best tier the CPU has, never `amx_emulated`;
`BERTFAST_ISA=<cap>` caps it (for tests, benchmarks and reproducible numerics): a tier's name (`amx_emulated`
runs wherever the CPU supports it, above a detected avx512_vnni too), or `avx512_vnni-nobf16`, the avx512_vnni
tier with AVX-512 BF16 hidden (a Cascade Lake or Ice Lake, or a VM whose hypervisor masks AVX-512 BF16 and AMX,
as a CPU with it can stand in for).

The extension owns the tier state and the one parse of BERTFAST_ISA (csrc/cpu/common/isa.cpp); this module reads
them through `_C` and mirrors them. Its own reading of the variable (`_environment_cap`) serves only a process
without the extension, where the cap still goes to the libraries. The libraries torch calls decide for themselves,
so `cap_libraries()` passes the same cap to them through their own variables (`ONEDNN_MAX_CPU_ISA`,
`MKL_ENABLE_INSTRUCTIONS`, `ATEN_CPU_CAPABILITY`, and for `portable` also `MKL_CBWR=COMPATIBLE`): one explicit
call, the only place bertfast changes the environment, effective only before torch runs its first GEMM
(`python -m bertfast` makes it first thing; importing bertfast sets nothing).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

from .ext import _C

TIERS = ("portable", "avx2", "avx512_vnni", "amx_emulated", "amx")
NO_BF16 = "avx512_vnni-nobf16"
EMULATED = "amx_emulated"
# What BERTFAST_ISA takes, lowest to highest: each cap's features include those of the caps below it (the
# extension's kCaps, tests/test_isa_owner.py checks they agree).
CAPS = ("portable", "avx2", NO_BF16, "avx512_vnni", EMULATED, "amx")

# What each tier's cap means to the libraries (their own names); `amx` is no cap. avx512_vnni-nobf16 is
# avx512_vnni's entry as it stands; library_caps raises avx512_vnni to AVX512_CORE_BF16 where the CPU has it.
_LIBRARY_CAPS = {
    "avx512_vnni": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
                    "ATEN_CPU_CAPABILITY": "avx512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    # MKL honours MKL_ENABLE_INSTRUCTIONS on Intel CPUs only; MKL_CBWR=COMPATIBLE is its SSE2 path on any
    # processor (docs/cpu-gemm.md#mkl-on-amd).
    "portable": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "MKL_CBWR": "COMPATIBLE",
                 "ATEN_CPU_CAPABILITY": "default"},
}
# The oneDNN caps under which it may use AMX (its names, lowest to highest, as ONEDNN_MAX_CPU_ISA takes them).
_ONEDNN_AMX = {"AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16",
               "AVX10_2_512_AMX_2", "ALL", "DEFAULT"}


def requested_cap() -> str | None:
    """The cap BERTFAST_ISA names (one of CAPS), or None when unset, as the extension parsed it when it loaded.
    Raises ValueError for an unknown name."""
    parsed = getattr(_C, "requested_cap", None)  # the extension's own parse; None without the extension
    return (parsed() or None) if parsed is not None else _environment_cap()


def _environment_cap() -> str | None:
    # BERTFAST_ISA read here, as the extension reads it: only where the extension does not (not built).
    value = os.environ.get("BERTFAST_ISA", "").strip()
    if value and value not in CAPS:
        raise ValueError(f"BERTFAST_ISA={value!r} is not an ISA tier; expected one of {', '.join(CAPS)}")
    return value or None


def cap_tier(cap: str | None) -> str | None:
    """The kernels' tier under a cap: the cap itself, or avx512_vnni for avx512_vnni-nobf16."""
    return "avx512_vnni" if cap == NO_BF16 else cap


def library_caps(cap: str | None) -> dict[str, str]:
    """The libraries' variables for a tier cap. avx512_vnni keeps AVX-512 BF16 where the CPU has it, as
    the extension's tier does (oneDNN's own next step up, AVX512_CORE_BF16, still excludes AMX); amx_emulated
    is avx512_vnni to them (they have no emulated tiles: what runs AMX under it is the extension's emulation)."""
    caps = dict(_LIBRARY_CAPS.get("avx512_vnni" if cap == EMULATED else cap_tier(cap), {}))
    if cap in ("avx512_vnni", EMULATED) and "avx512_bf16" in proc_cpuinfo()[1]:
        caps["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"
    return caps


# The library variables cap_libraries set in this process (not the user's): a child process run under another cap
# must not inherit them.
APPLIED: dict[str, str] = {}


def cap_libraries(cap: str | None = None) -> dict[str, str]:
    """Pass an ISA cap to oneDNN, MKL and ATen through their own variables (`library_caps`), each unless the user set
    it, and return the ones set. cap: one of CAPS; None (the default) is BERTFAST_ISA's (`requested_cap()`), under
    which the kernels run, so that the libraries beside them run under the same cap.

    The one call through which bertfast changes the environment: make it before torch runs its first GEMM in the
    process (the libraries read their variables once, then); later it changes nothing they run. `python -m bertfast`
    makes it before any command, the test suite's conftest before any test; a program importing bertfast makes it
    itself, first thing. It does not move the kernels' tier (BERTFAST_ISA, or `on_cap` in tests)."""
    if cap is None:
        cap = requested_cap()
    elif cap not in CAPS:
        raise ValueError(f"{cap!r} is not an ISA cap; expected one of {', '.join(CAPS)}")
    applied = {}
    for name, value in library_caps(cap).items():
        if name not in os.environ:
            os.environ[name] = APPLIED[name] = applied[name] = value
    return applied


def check_requested_cap() -> None:
    """BERTFAST_ISA's cap checked once, when bertfast is imported: an unknown name raises ValueError, and amx_emulated
    on a CPU that cannot run it (no AVX-512 VNNI), where the kernels run the CPU's best tier instead, warns (a test
    run under that name must hear about it)."""
    if requested_cap() == EMULATED and _C is not None and _C.isa() != EMULATED:
        warnings.warn(f"BERTFAST_ISA={EMULATED}: {unsupported(EMULATED)}; the kernels run {_C.isa()}, not the AMX "
                      "code", stacklevel=2)


def supported_tiers() -> list[str]:
    """The tiers this CPU runs, highest first: every tier up to the extension's detected one, and amx_emulated
    where the CPU has AVX-512 VNNI and BF16 ([] without the extension)."""
    if _C is None:
        return []
    return [tier for tier in reversed(TIERS) if _C.isa_supported(tier)]


def supported_caps() -> list[str]:
    """The caps that run distinct code on this CPU, highest first: its tiers, with avx512_vnni-nobf16 after
    avx512_vnni where the CPU has AVX-512 BF16 to hide (without it, the two caps are the same)."""
    caps = []
    for tier in supported_tiers():
        caps.append(tier)
        if tier == "avx512_vnni" and "avx512_bf16" in proc_cpuinfo()[1]:
            caps.append(NO_BF16)
    return caps


def unsupported(cap: str, supported: list[str] | None = None) -> str | None:
    """Why `cap` cannot run on this CPU, or None when it can (supported: `supported_caps()` by default)."""
    supported = supported_caps() if supported is None else supported
    if not supported:
        return "bertfast._C is not built: the CPU's tiers are unknown (run bash install.sh)"
    if cap == NO_BF16 and "avx512_vnni" in supported and cap not in supported:
        return "this CPU has no AVX-512 BF16 to hide: its avx512_vnni tier is this cap already"
    if cap == EMULATED and cap not in supported:
        return "amx_emulated needs a CPU with AVX-512 VNNI (the AMX kernels' code around the tiles)"
    if cap not in supported:
        best = next(t for t in supported if t != EMULATED)
        return f"this CPU does not support the {cap} tier (its best: {best})"
    return None


def native_bf16() -> bool:
    """Whether the active tier has native bf16 dot products: `amx`, `amx_emulated` (the amx tier's arithmetic),
    or `avx512_vnni` on a CPU with AVX-512 BF16 (`active_cap()` one of those three). Below that, bf16 saves memory
    traffic but not arithmetic (docs/cpu-gemm.md#bf16-without-native-dot-products). Without the extension the CPU
    flags and BERTFAST_ISA's cap decide."""
    if _C is None:
        cap = requested_cap()
        return "avx512_bf16" in proc_cpuinfo()[1] and (cap is None or CAPS.index(cap) >= CAPS.index("avx512_vnni"))
    return active_cap() in ("amx", EMULATED, "avx512_vnni")


def active_cap() -> str | None:
    """The cap the kernels run under: the active tier, or avx512_vnni-nobf16 for avx512_vnni without AVX-512 BF16
    dot products (hidden, or absent from the CPU); None without the extension."""
    if _C is None:
        return None
    tier = _C.isa()
    return NO_BF16 if tier == "avx512_vnni" and not _C.has_avx512_bf16() else tier


def _select(tier: str, bf16: bool) -> None:
    # AVX-512 BF16 on before a tier that needs it (the amx tiers), off only once the tier no longer does.
    ok = _C.set_avx512_bf16(True) if bf16 else True
    ok = ok and _C.set_isa(tier) and _C.isa() == tier
    ok = ok and (bf16 or _C.set_avx512_bf16(False))
    if not ok:  # a cap the CPU lacks (isa.unsupported says why)
        raise RuntimeError(f"cannot select the {tier} tier with AVX-512 BF16 {'on' if bf16 else 'off'} on this CPU")


@contextlib.contextmanager
def on_cap(cap: str):
    """The kernels on `cap` (one of CAPS the CPU supports) inside the block, as BERTFAST_ISA would select them; the
    tier and AVX-512 BF16 as they were after it. A cap other than avx512_vnni-nobf16 runs with the CPU's AVX-512 BF16
    where it has it, also in a process started under BERTFAST_ISA=avx512_vnni-nobf16 (where it starts hidden). For
    tests and benchmarks: the choice is process-wide."""
    before = (_C.isa(), _C.has_avx512_bf16())
    _select(cap_tier(cap), cap != NO_BF16 and "avx512_bf16" in proc_cpuinfo()[1])
    try:
        yield cap
    finally:
        _select(*before)


@functools.lru_cache(maxsize=1)
def proc_cpuinfo() -> tuple[str, frozenset[str]]:
    """The CPU model name and flags from /proc/cpuinfo (empty where there is none), read once."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: the extension still reports its tiers
        pass
    return model, frozenset(flags)


def cpu_info() -> dict:
    """What this process runs on: the CPU model, the tier the CPU supports (`detected`), the tier the native
    kernels run (`active`, after the cap: `amx_emulated` where the AMX kernels run on emulated tiles), the
    cap asked for (`cap`), whether the CPU runs amx_emulated (`amx_emulated`), the relevant CPU flags, what the
    libraries were told (`onednn_max_isa`, `mkl_instructions`, `mkl_cbwr`, `aten_capability`) with whether
    oneDNN and MKL may use AMX under it, and whether the active tier has native bf16 dot products
    (`native_bf16`, what dtype="auto" follows).
    """
    import torch

    model, flags = proc_cpuinfo()
    detected = _C.detected_isa() if _C is not None else None
    active = _C.isa() if _C is not None else None
    hw_amx = {"amx_tile", "amx_bf16", "amx_int8"} <= flags
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", ""))
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "")
    cbwr = os.environ.get("MKL_CBWR", "")
    try:
        aten = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        aten = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return {
        "cpu": model or "unknown",
        "detected": detected,
        "active": active,
        "cap": requested_cap(),
        "amx_emulated": bool(_C.isa_supported(EMULATED)) if _C is not None else None,
        "flags": sorted(flags & {"avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16",
                                 "amx_tile", "amx_bf16", "amx_int8"}),
        "onednn_max_isa": onednn_isa or "default",
        "mkl_instructions": mkl or "default",
        "mkl_cbwr": cbwr or "default",
        "aten_capability": aten,
        "onednn_amx": hw_amx and (not onednn_isa or onednn_isa.upper() in _ONEDNN_AMX),
        "mkl_amx": hw_amx and (not mkl or mkl.upper().startswith("AVX512_E4")) and not cbwr,
        "native_bf16": native_bf16() if _C is not None else None,
    }


def describe(info: dict | None = None) -> str:
    """One line for command output: `cpu <model> | isa <active> (detected <tier>, cap <cap>) | ...`."""
    info = cpu_info() if info is None else info
    cap = info["cap"] or "none"
    return (f"cpu {info['cpu']} | isa {info['active']} (detected {info['detected']}, cap {cap}) | "
            f"oneDNN {info['onednn_max_isa']} amx={info['onednn_amx']} | MKL {info['mkl_instructions']} "
            f"cbwr={info.get('mkl_cbwr', 'default')} amx={info['mkl_amx']} | bf16 native={info.get('native_bf16')}")
