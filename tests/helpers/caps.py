"""Running the native kernels under one ISA cap inside a test process, as BERTFAST_ISA would, and back."""

from __future__ import annotations

from contextlib import contextmanager

from bertfast.backends.cpu import isa as isa_module


def _select(_C, tier: str, bf16: bool) -> None:
    # AVX-512 BF16 on before a tier that needs it (the amx tiers), off only once the tier no longer does.
    if bf16:
        assert _C.set_avx512_bf16(True)
    assert _C.set_isa(tier) and _C.isa() == tier
    if not bf16:
        assert _C.set_avx512_bf16(False)


@contextmanager
def on_cap(cap: str):
    """The kernels on `cap` (one of isa.CAPS the CPU supports) inside the block; the tier and AVX-512 BF16 as they
    were after it. A cap other than avx512_vnni-nobf16 runs with the CPU's AVX-512 BF16 where it has it, also in a
    process started under BERTFAST_ISA=avx512_vnni-nobf16 (where it starts hidden)."""
    from bertfast import _C

    before = (_C.isa(), _C.has_avx512_bf16())
    cpu_bf16 = "avx512_bf16" in isa_module.proc_cpuinfo()[1]
    _select(_C, isa_module.cap_tier(cap), cap != isa_module.NO_BF16 and cpu_bf16)
    try:
        yield cap
    finally:
        _select(_C, *before)
