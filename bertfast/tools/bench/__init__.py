"""`bertfast bench`: the benchmark command, one module per seam, dependencies pointing one way:
`measure` (the one interleaved timer, also used by `bertfast demo` and benchmarks/) and `source` (the
reference model) at the bottom; `providers` (the named rows) on `source`; `process` (where a provider
runs) on those; `runner` (the run loop and validation) on `process`; `report`, `plot` and `tiers`
beside it; `cli` (`add_arguments`, `run`) at the top. Method: docs/bench-method.md.
"""
