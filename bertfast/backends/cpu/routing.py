"""The CPU GEMM routing rule, in one place: which kernel runs a GEMM, from its dtype, token count, shape
and the active ISA tier. Every threshold is here; the measurements behind them are in docs/cpu-gemm.md
(fp32/bf16) and docs/int8.md#gemm. Inside the extension's kernel, the streaming / blocked / AMX regime is
the kernel's own choice (csrc/cpu/linear.cpp)."""

from __future__ import annotations

import sys

import torch

EXT = "ext"            # the extension's kernel on weights packed at load, epilogue fused (_C.linear, _C.quant_linear)
ONEDNN = "onednn"      # oneDNN on a weight prepacked at load: bf16 with native dot products, int8 on AMX
TORCH_FP32 = "torch"   # torch's fp32 GEMM (MKL sgemm); bf16 operands widened to fp32

AVX512_TIERS = ("avx512_vnni", "amx")
FP32_NATIVE_ROWS_AVX2 = 256         # fp32 on avx2: MKL past this (docs/cpu-gemm.md#mkl-fp32)
BF16_NATIVE_ROWS = 64                # bf16 with native dot products: oneDNN past this (#routing)
BF16_PORTABLE_ROWS = 256             # portable bf16: widened fp32 GEMM past this (#bf16-without-native-dot-products)
INT8_AMX_NATIVE_ROWS = 128           # int8 on the amx tier: oneDNN's AMX GEMM past this (docs/int8.md#amx-routing)
ONEDNN_MAX_ROWS = 384                # oneDNN bf16 in row blocks of at most this many rows ...
ONEDNN_BLOCK_MIN_OUT = 768           # ... when out_features is in [this, in_features] (#onednn-row-blocks)


def native_rows(dtype, tier: str, native_bf16: bool) -> int:
    """The largest token count whose GEMMs of `dtype` (torch.float32, torch.bfloat16 or "int8") run on the
    extension's kernel on `tier`; above it `gemm_kernel` names the library."""
    if dtype == "int8":
        return INT8_AMX_NATIVE_ROWS if tier == "amx" else sys.maxsize  # no oneDNN int8 below AMX: a reference kernel
    if dtype == torch.float32:
        # portable: its blocked regime matches MKL's SSE2 sgemm and fuses the epilogue (docs/cpu-gemm.md#portable-blocked)
        return FP32_NATIVE_ROWS_AVX2 if tier == "avx2" else sys.maxsize
    if native_bf16:
        return BF16_NATIVE_ROWS
    return BF16_PORTABLE_ROWS if tier == "portable" else sys.maxsize  # never oneDNN's bf16 emulation


def gemm_kernel(dtype, rows: int, tier: str, native_bf16: bool) -> str:
    """EXT, ONEDNN or TORCH_FP32 for a GEMM of `rows` tokens."""
    return EXT if rows <= native_rows(dtype, tier, native_bf16) else library_kernel(dtype, native_bf16)


def library_kernel(dtype, native_bf16: bool) -> str:
    """The kernel past the extension's rows: ONEDNN (int8, bf16 with native dot products) or TORCH_FP32."""
    return ONEDNN if dtype == "int8" or (dtype == torch.bfloat16 and native_bf16) else TORCH_FP32


def onednn_row_block(rows: int, out_features: int, in_features: int) -> int:
    """Rows per oneDNN bf16 call: all of them, or equal blocks of at most ONEDNN_MAX_ROWS where that is faster."""
    if rows <= ONEDNN_MAX_ROWS or not ONEDNN_BLOCK_MIN_OUT <= out_features <= in_features:
        return rows
    return -(-rows // -(-rows // ONEDNN_MAX_ROWS))
