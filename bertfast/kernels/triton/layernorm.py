"""Residual add + LayerNorm in one pass over each row: ``LayerNorm(x + residual)``.

A program owns one row of ``N`` features, held whole in registers as fp32 (BLOCK_N = next power of
two of N, masked): the sum, mean and variance are taken from that copy, the variance around the
mean (two passes over registers, not over memory), so rows far from zero do not cancel. eps is a
runtime argument. The row helper `_layernorm_row` is shared with the embedding kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ROW_CONFIGS, _layernorm_row, check_device, check_float, check_shape, next_pow2


@triton.autotune(configs=ROW_CONFIGS, key=["BLOCK_N"])
@triton.jit
def _layernorm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr,
    N, eps,
    stride_xm, stride_xn, stride_rm, stride_rn, stride_om,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_xm + offs * stride_xn, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_rm + offs * stride_rn, mask=mask, other=0.0).to(tl.float32)
    y = _layernorm_row(x, w_ptr, b_ptr, offs, mask, N, eps)
    tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm over the last dim of ``x + residual`` (residual optional), fp32 statistics.

    x: (M, N), any strides; residual: (M, N) or None; weight, bias: (N,); all one float dtype and
    device; eps: float > 0 (a runtime argument: new values do not recompile).
    Returns (M, N) contiguous in x's dtype.
    """
    op = "layernorm"
    check_float(op, "x", x, 2)
    M, N = x.shape
    check_float(op, "weight", weight, 1, x.dtype)
    check_float(op, "bias", bias, 1, x.dtype)
    check_shape(op, "weight", weight, (N,))
    check_shape(op, "bias", bias, (N,))
    tensors = [x, weight, bias]
    if residual is not None:
        check_float(op, "residual", residual, 2, x.dtype)
        check_shape(op, "residual", residual, (M, N))
        tensors.append(residual)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive float, got {eps!r}")
    check_device(op, *tensors)
    if N == 0:
        raise ValueError(f"{op}: cannot normalise rows of 0 features")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M > 0:
        res = residual if residual is not None else x
        _layernorm_kernel[(M,)](
            x, res, weight, bias, out, N, float(eps),
            x.stride(0), x.stride(1), res.stride(0), res.stride(1), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_N=next_pow2(N),
        )
    return out


def aot_variants(dtype: torch.dtype = torch.float16, hidden: int = 768):
    """A representative BERT-base residual + LayerNorm launch for `bertfast kernels`:
    yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    block_n = next_pow2(hidden)
    yield ("layernorm", _layernorm_kernel.fn,
           {"x_ptr": t, "res_ptr": t, "w_ptr": t, "b_ptr": t, "out_ptr": t, "N": hidden, "eps": 1e-12,
            "stride_xm": hidden, "stride_xn": 1, "stride_rm": hidden, "stride_rn": 1, "stride_om": hidden,
            "HAS_RESIDUAL": True, "BLOCK_N": block_n},
           ROW_CONFIGS)
