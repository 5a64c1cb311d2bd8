"""The cpu backend: native C++ kernels (csrc/, `bertfast._C`) per ISA tier, chosen once at import.

`isa` (tiers and the library caps), `ext` (the extension, imported once), `linear` (fp32/bf16 weights and
GEMM), `quant` (int8), `backend` (`CpuBackend`). The registry
imports `backend` lazily; this package imports nothing so that `isa` can run first.
"""
