"""DeBERTa-v2's per-token position terms: out[t, h, r] = scale * x[t, h, :] . pos[r, h, :] (c2p: x = q, pos = the
layer's key projections of the relative embeddings; p2c: x = k, pos = its query projections), the (T, heads, rows)
float32 tables the varlen attention gathers per score tile (`bertfast.disentangled` explains the terms).

Batch invariance by construction: one fixed tile per dtype and head dim (no autotuning, nothing keyed on T), so each
entry is the same dot products over the head's channels in the same order whatever the token count, the row's place
in the batch or the entry's column (the batch's width moves a projection row to another column). The mirror of
`_C.position_scores` (csrc/cpu/attention/disentangled.cpp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, dot_precision, next_pow2

# One tile for every launch: [BLOCK_M tokens, BLOCK_N rows] of one head, the head dim (BLOCK_D) in steps of
# BLOCK_K: the whole of it on tensor cores (fp16, bf16), 16 channels at a time in fp32, whose "ieee" dot runs on the
# FMA units with its operands in registers (the whole head dim at once spilled ~1 KB per thread on sm_80 and sm_90).
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 64, 4


def block_k(dtype: torch.dtype, block_d: int) -> int:
    return 16 if dtype == torch.float32 else block_d


@triton.jit(do_not_specialize=["tokens", "rows", "scale"])
def _position_scores_kernel(
    x_ptr, pos_ptr, out_ptr,
    tokens, rows, heads, head_dim, scale,
    stride_xt, stride_xh, stride_xd, stride_pr, stride_pc,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    pid_n = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < tokens
    mask_n = offs_n < rows
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + h * stride_xh + offs_k[None, :] * stride_xd
    pos_ptrs = pos_ptr + offs_n[None, :] * stride_pr + (h * head_dim + offs_k[:, None]) * stride_pc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, BLOCK_D, BLOCK_K):
        mask_k = offs_k < head_dim - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        pos = tl.load(pos_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, pos, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xd
        pos_ptrs += BLOCK_K * stride_pc
    out_rows = (offs_m.to(tl.int64) * heads + h) * rows  # [BLOCK_M]
    tl.store(out_ptr + out_rows[:, None] + offs_n[None, :], acc * scale, mask=mask_m[:, None] & mask_n[None, :])


def position_scores(x: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One position term's table: out[t, h, r] = scale * x[t, h, :] . pos[r, h * d:(h + 1) * d], fp32 accumulation.

    x: (T, heads, d), any strides (q or k as the QKV kernel leaves them); pos: (rows, heads * d) in x's dtype, any
    strides; one device. Returns (T, heads, rows) float32, contiguous (what `attention_varlen` gathers from).
    """
    op = "position_scores"
    check_float(op, "x", x, 3)
    check_float(op, "pos", pos, 2, x.dtype)
    T, heads, d = x.shape
    if pos.shape[0] < 1 or pos.shape[1] != heads * d:
        raise ValueError(f"{op}: pos must be (rows > 0, heads * d = {heads * d}), got {tuple(pos.shape)}")
    check_device(op, x, pos)
    rows = pos.shape[0]
    out = torch.empty(T, heads, rows, dtype=torch.float32, device=x.device)
    if T == 0 or heads == 0 or d == 0:
        return out.zero_()
    grid = (triton.cdiv(T, BLOCK_M), heads, triton.cdiv(rows, BLOCK_N))
    block_d = max(16, next_pow2(d))
    _position_scores_kernel[grid](
        x, pos, out, T, rows, heads, d, scale,
        x.stride(0), x.stride(1), x.stride(2), pos.stride(0), pos.stride(1),
        INPUT_PRECISION=dot_precision(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        BLOCK_K=block_k(x.dtype, block_d), num_warps=NUM_WARPS,
    )
    return out


def aot_variants(dtype: torch.dtype = torch.float16, heads: int = 12, head_dim: int = 64, rows: int = 256):
    """deberta-v3-base's launch (12 heads of 64, 256 position rows, q from the QKV kernel's (T, heads, d) plane) for
    `bertfast kernels`: yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    block_d = max(16, next_pow2(head_dim))
    values = {"x_ptr": t, "pos_ptr": t, "out_ptr": torch.empty(16, dtype=torch.float32), "tokens": 1024,
              "rows": rows, "heads": heads, "head_dim": head_dim, "scale": 0.07, "stride_xt": heads * head_dim,
              "stride_xh": head_dim, "stride_xd": 1, "stride_pr": heads * head_dim, "stride_pc": 1,
              "INPUT_PRECISION": dot_precision(dtype), "BLOCK_D": block_d,
              "BLOCK_K": block_k(dtype, block_d)}
    config = triton.Config({"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N}, num_warps=NUM_WARPS, num_stages=1)
    yield ("position_scores", _position_scores_kernel, values, [config])
