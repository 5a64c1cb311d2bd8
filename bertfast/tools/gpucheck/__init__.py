"""`bertfast gpucheck`: the one command that checks the GPU engine on a CUDA GPU (`cli`: the stages in child
processes and the summary; `stages`: each stage's body; `parity`: every family against transformers; `gemm`: fused
Triton GEMMs against cuBLAS per shape, the table `backends/gemm_table.json` is made from)."""
