"""Fused QKV projection: one GEMM ``x @ qkv_weight.T + qkv_bias`` whose epilogue scatters the
``3H`` output columns straight into three ``(T, heads, d)`` tensors, the layout attention reads.

Output column ``n`` of the fused ``[3H, H]`` weight belongs to tensor ``n // H`` (q, k, v), head
``(n % H) // d`` and channel ``n % d``; in a contiguous ``(T, heads, d)`` tensor that element sits
at ``t * H + n % H``, so the epilogue needs no per-head arithmetic, only the split into three
planes. No transpose or copy follows. The softmax scale can be folded into q here for free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (CONFIGS, _CONFIGS, _gemm_tile, _program_tile, _prune_configs, check_device, check_float,
                      check_shape, dot_precision, next_pow2)


@triton.autotune(configs=CONFIGS, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=["M", "m_bucket", "q_scale"])
def _qkv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, m_bucket, hidden, q_scale,
    stride_xm, stride_xk, stride_wn, stride_wk,
    HAS_BIAS: tl.constexpr, SCALE_Q: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # out_ptr is a contiguous [3, M, hidden] buffer: planes q, k, v, each [M, heads, d].
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                                     pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += bias[None, :]
    plane = offs_n // hidden  # 0 = q, 1 = k, 2 = v
    if SCALE_Q:
        acc = tl.where((plane == 0)[None, :], acc * q_scale, acc)
    col = offs_n - plane * hidden
    # int64: 3 * M * hidden passes 2^31 at ~700k tokens of BERT-large.
    offs_out = plane.to(tl.int64)[None, :] * M * hidden + offs_m.to(tl.int64)[:, None] * hidden + col[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=mask)

def qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
        q_scale: float | None = None):
    """Fused Q/K/V projection.

    x: (T, H); weight: (3H, H), rows q | k | v; bias: (3H,) or None; all one float dtype and device.
    q_scale: if given, q is multiplied by it (e.g. 1/sqrt(d), so attention can use scale 1).
    Returns q, k, v: each (T, heads, d) contiguous, d = H // num_heads, views of one buffer.
    """
    op = "qkv"
    check_float(op, "x", x, 2)
    T, H = x.shape
    if not isinstance(num_heads, int) or num_heads <= 0 or H == 0 or H % num_heads:
        raise ValueError(f"{op}: num_heads = {num_heads!r} must be a positive int dividing hidden {H}")
    check_float(op, "weight", weight, 2, x.dtype)
    check_shape(op, "weight", weight, (3 * H, H))
    if bias is not None:
        check_float(op, "bias", bias, 1, x.dtype)
        check_shape(op, "bias", bias, (3 * H,))
    check_device(op, *([x, weight] + ([bias] if bias is not None else [])))
    d = H // num_heads
    out = torch.empty(3, T, num_heads, d, dtype=x.dtype, device=x.device)
    if T > 0:
        N = 3 * H
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _qkv_kernel[grid](
            x, weight, bias if bias is not None else x, out,
            T, N, H, next_pow2(T), H, 1.0 if q_scale is None else float(q_scale),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            HAS_BIAS=bias is not None, SCALE_Q=q_scale is not None,
            INPUT_PRECISION=dot_precision(x.dtype),
        )
    return out[0], out[1], out[2]

def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """A representative BERT-base fused QKV launch for `bertfast kernels`:
    yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    configs = _prune_configs(_CONFIGS, {"M": tokens, "x_ptr": t})
    yield ("qkv", _qkv_kernel.fn,
           {"x_ptr": t, "w_ptr": t, "b_ptr": t, "out_ptr": t, "M": tokens, "N": 3 * hidden, "K": hidden,
            "m_bucket": next_pow2(tokens), "hidden": hidden, "q_scale": 0.125, "stride_xm": hidden,
            "stride_xk": 1, "stride_wn": hidden, "stride_wk": 1, "HAS_BIAS": True, "SCALE_Q": True,
            "INPUT_PRECISION": dot_precision(dtype)}, configs)
