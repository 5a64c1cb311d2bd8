"""Running the native kernels under one ISA cap inside a test process, as BERTFAST_ISA would, and back
(bertfast.backends.cpu.isa.on_cap, which the benchmarks use too)."""

from __future__ import annotations

from bertfast.backends.cpu.isa import on_cap  # noqa: F401
