"""The CUDA side of the backends: `triton` (`TritonBackend`: Triton kernels, on CUDA or under the Triton interpreter),
`graphs` (the engine's CUDA graphs per token-count bucket), `gemm_choice` (the triton backend's measured routing of
each GEMM to Triton, cuBLAS or the TMA kernel). The registry imports `triton` lazily; this package imports nothing, so
a machine without triton or CUDA imports `graphs` all the same.
"""
