"""The cpu backend: native C++ kernels (csrc/, `bertfast._C`) per ISA tier, chosen once at import.

`isa` (the tiers as the extension reports them, and `cap_libraries`), `ext` (the extension, imported once), `linear`
(fp32/bf16 weights and GEMM), `quant` (int8), `backend` (`CpuBackend`). The registry imports `backend` lazily.
"""
