"""GEMM with a fused epilogue: ``out = act(x @ weight.T + bias) (+ residual)``, and its gated form.

One kernel serves the FFN input projection (bias + GELU/ReLU), the output projections (bias +
residual add) and the pooler (bias + tanh). The main loop (`_gemm_tile`) is shared with the fused
QKV kernel; it accumulates in fp32 whatever the input dtype, and the epilogue applies bias,
activation and residual on the fp32 accumulator before a single rounding to the output dtype.
The gated kernel (GeGLU, SwiGLU: ``act(x @ a.T + bias_a) * (x @ b.T + bias_b)``) keeps one accumulator
per half (`_gemm_pair_tile`), so the gate is applied in registers and the (M, 2N) product never exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation import GATED_IDS
from ..activation import IDS as ACTIVATIONS
from ._common import (_CONFIGS, _PAIR_CONFIGS, CONFIGS, PAIR_CONFIGS, _gemm_pair_tile, _gemm_tile, _program_tile,
                      _prune_configs, _prune_pair_configs, check_device, check_float, check_shape, dot_precision,
                      next_pow2)


@triton.jit
def _tanh(x):
    # tanh from exp(-2|x|) in (0, 1]: no overflow at either tail, odd by construction; libdevice's
    # tanh is not available under the interpreter.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _apply_activation(acc, ACTIVATION: tl.constexpr):
    """acc: fp32 tile; ACTIVATION one of ACTIVATIONS."""
    if ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (1.0 + _tanh(inner))
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "tanh":
        acc = _tanh(acc)
    elif ACTIVATION == "silu":
        # x * sigmoid(x), the sigmoid from e^-|x| in (0, 1] as in _tanh: no overflow at either tail.
        e = tl.exp(-tl.abs(acc))
        acc = acc * tl.where(acc >= 0, 1.0, e) / (1.0 + e)
    return acc


@triton.jit
def _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, res_ptr, stride_rm, stride_rn, out_ptr, stride_om, hidden,
                   q_scale, add_ptr, stride_am, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, SPLIT_QKV: tl.constexpr, SCALE_Q: tl.constexpr,
                   HAS_ADDEND: tl.constexpr):
    """The fused GEMMs' one epilogue, on the fp32 tile [BLOCK_M, BLOCK_N] of rows offs_m and columns offs_n: + bias,
    + the fp32 addend's rows of stride_am (HAS_ADDEND: LoRA deltas, before any activation), then either the QKV split into the [3, M, hidden] planes q, k, v that attention reads (q times q_scale with
    SCALE_Q), or the activation and + residual into out's rows of stride_om; one rounding to out's dtype. Every fused
    GEMM kernel (linear, qkv, the persistent layer, the TMA and fp8 GEMMs) ends here, so a row's epilogue is the same
    arithmetic whichever computed its tile."""
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += bias[None, :]
    if HAS_ADDEND:
        acc += tl.load(add_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], mask=mask,
                       other=0.0)  # [BLOCK_M, BLOCK_N] fp32
    if SPLIT_QKV:
        plane = offs_n // hidden  # 0 = q, 1 = k, 2 = v
        if SCALE_Q:
            acc = tl.where((plane == 0)[None, :], acc * q_scale, acc)
        col = offs_n - plane * hidden
        # int64: 3 * M * hidden passes 2^31 at ~700k tokens of BERT-large.
        offs_out = plane.to(tl.int64)[None, :] * M * hidden + offs_m.to(tl.int64)[:, None] * hidden + col[None, :]
    else:
        acc = _apply_activation(acc, ACTIVATION)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask,
                          other=0.0)  # [BLOCK_M, BLOCK_N]
            acc += res.to(tl.float32)
        offs_out = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=CONFIGS, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=["M", "m_bucket"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, add_ptr, out_ptr,
    M, N, K, m_bucket,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_am, stride_om,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ADDEND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # m_bucket (next power of two of M) keys the autotuner and M is not specialised on: a new token
    # count reuses its bucket's tuned config and never recompiles. out_ptr: (M, N), unit stride along N.
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                                     pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, res_ptr, stride_rm, stride_rn, out_ptr, stride_om, N, 1.0,
                   add_ptr, stride_am, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, False, False, HAS_ADDEND)


@triton.autotune(configs=PAIR_CONFIGS, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_pair_configs})
@triton.jit(do_not_specialize=["M", "m_bucket"])
def _linear_gated_kernel(
    x_ptr, w_ptr, b_ptr, add_ptr, out_ptr,
    M, N, K, m_bucket,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_am, stride_om, stride_on,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADDEND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Output column n pairs weight row n (the gate's input a) with row N + n (the value b).
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc_a, acc_b = _gemm_pair_tile(x_ptr, w_ptr, K, stride_xm, stride_xk, stride_wn, stride_wk, offs_m, mask_m,
                                   offs_n, offs_n + N, mask_n, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    if HAS_BIAS:
        bias_a = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        bias_b = tl.load(b_ptr + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc_a += bias_a[None, :]
        acc_b += bias_b[None, :]
    if HAS_ADDEND:  # the addend's columns [0, N) add to the gate's input a, [N, 2N) to the value b
        mask = mask_m[:, None] & mask_n[None, :]
        add_a = add_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
        acc_a += tl.load(add_a, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_N] fp32
        acc_b += tl.load(add_a + N, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_N] fp32
    out = _apply_activation(acc_a, ACTIVATION) * acc_b
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check_operands(op: str, x, weight, bias, rows_per_n: int):
    """x (M, K), weight (rows_per_n * N, K), bias (rows_per_n * N,) or None, one dtype; returns M, N, K."""
    check_float(op, "x", x, 2)
    check_float(op, "weight", weight, 2, x.dtype)
    M, K = x.shape
    if weight.shape[1] != K:
        raise ValueError(f"{op}: x is {tuple(x.shape)} but weight is {tuple(weight.shape)}; "
                         "weight must be (N, K) with K = x.shape[1]")
    if weight.shape[0] % rows_per_n:
        raise ValueError(f"{op}: weight has {weight.shape[0]} rows; a gated weight holds two halves [a; b], "
                         "an even number of rows")
    N = weight.shape[0] // rows_per_n
    if bias is not None:
        check_float(op, "bias", bias, 1, x.dtype)
        check_shape(op, "bias", bias, (weight.shape[0],))
    if K == 0:
        raise ValueError(f"{op}: K = 0 (empty inner dimension) is not supported")
    return M, N, K


def epilogue_operands(op: str, x, bias, residual, M: int, N: int, addend=None) -> list:
    """The epilogue's tensors that are given (bias, residual, addend), a residual checked as (M, N) in x's dtype and
    an addend as (M, N) float32 contiguous along N: what a linear launcher hands `check_device` beside x and the
    weight."""
    if residual is not None:
        check_float(op, "residual", residual, 2, x.dtype)
        check_shape(op, "residual", residual, (M, N))
    if addend is not None:
        check_float(op, "addend", addend, 2, torch.float32)
        check_shape(op, "addend", addend, (M, N))
        if addend.stride(1) != 1 and N > 1:
            raise ValueError(f"{op}: addend must be contiguous along its columns, got strides {addend.stride()}")
    return [t for t in (bias, residual, addend) if t is not None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str = "none", residual: torch.Tensor | None = None,
           addend: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias + addend) + residual`` in one kernel, fp32 accumulation.

    x: (M, K); weight: (N, K) (the torch.nn.Linear layout); bias: (N,) or None; residual: (M, N)
    or None, added after the activation; addend: (M, N) float32 or None (LoRA deltas), added before it;
    activation in ACTIVATIONS. All the same float dtype (the addend fp32) and device; any strides.
    Returns (M, N) contiguous in x's dtype.
    """
    op = "linear"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
    M, N, K = _check_operands(op, x, weight, bias, 1)
    check_device(op, x, weight, *epilogue_operands(op, x, bias, residual, M, N, addend))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    res = residual if residual is not None else out  # never read when HAS_RESIDUAL is False
    add = addend if addend is not None else res  # never read when HAS_ADDEND is False
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, res, add, out,
        M, N, K, next_pow2(M),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), res.stride(0), res.stride(1), add.stride(0),
        out.stride(0),
        ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HAS_ADDEND=addend is not None, INPUT_PRECISION=dot_precision(x.dtype),
    )
    return out


def linear_gated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 activation: str, addend: torch.Tensor | None = None) -> torch.Tensor:
    """The gated FFN projection (GeGLU, SwiGLU): ``act(x @ a.T + bias_a) * (x @ b.T + bias_b)``, one kernel.

    x: (M, K); weight: (2N, K), rows [a; b]; bias: (2N,) or None; activation in GATED_IDS; addend: (M, 2N)
    float32 or None, its halves added to a's and b's products before the gate; one float dtype and device, any
    strides. Returns (M, N) contiguous in x's dtype.
    """
    op = "linear_gated"
    if activation not in GATED_IDS:
        raise ValueError(f"{op}: unknown gate activation {activation!r} (expected one of {', '.join(GATED_IDS)})")
    M, N, K = _check_operands(op, x, weight, bias, 2)
    check_device(op, x, weight, *epilogue_operands(op, x, bias, None, M, 2 * N, addend))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    add = addend if addend is not None else out  # never read when HAS_ADDEND is False
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _linear_gated_kernel[grid](
        x, weight, bias if bias is not None else x, add, out,
        M, N, K, next_pow2(M),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), add.stride(0), out.stride(0), out.stride(1),
        ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_ADDEND=addend is not None,
        INPUT_PRECISION=dot_precision(x.dtype),
    )
    return out


def linear_gelu(x, weight, bias, act: str = "gelu") -> torch.Tensor:
    """``act(x @ weight.T + bias)``; act in 'gelu' (erf), 'gelu_tanh', 'relu' (also 'tanh', 'none').

    x: (M, K); weight: (N, K); bias: (N,). Returns (M, N) in x's dtype.
    """
    return linear(x, weight, bias, activation=act)


def linear_residual(x, weight, bias, residual) -> torch.Tensor:
    """``x @ weight.T + bias + residual``. x: (M, K); weight: (N, K); bias: (N,); residual: (M, N)."""
    if residual is None:
        raise ValueError("linear_residual: residual is required (use linear() without one)")
    return linear(x, weight, bias, residual=residual)


def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """Representative BERT-base launches for ahead-of-time builds (`bertfast kernels`): the FFN input
    projection (bias + GELU; also with LoRA terms), an output projection (bias + residual), contiguous operands,
    and the gated projections without biases (ModernBERT's GeGLU, NomicBERT's and GTE's SwiGLU, intermediate 4H).
    Yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    inter = 4 * hidden
    configs = _prune_configs(_CONFIGS, {"M": tokens, "x_ptr": t})
    common = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "res_ptr": t, "add_ptr": t, "out_ptr": t, "M": tokens,
              "m_bucket": next_pow2(tokens), "stride_xk": 1, "stride_wk": 1, "stride_rn": 1, "stride_am": 0,
              "HAS_BIAS": True, "HAS_ADDEND": False, "INPUT_PRECISION": dot_precision(dtype)}
    yield ("linear_gelu", _linear_kernel.fn,
           {**common, "N": inter, "K": hidden, "stride_xm": hidden, "stride_wn": hidden, "stride_rm": inter,
            "stride_om": inter, "ACTIVATION": "gelu", "HAS_RESIDUAL": False}, configs)
    yield ("linear_residual", _linear_kernel.fn,
           {**common, "N": hidden, "K": inter, "stride_xm": inter, "stride_wn": inter, "stride_rm": hidden,
            "stride_om": hidden, "ACTIVATION": "none", "HAS_RESIDUAL": True}, configs)
    yield ("linear_gelu_lora", _linear_kernel.fn,  # with the rows' LoRA terms (`kernels.triton.lora`'s fp32 addend)
           {**common, "add_ptr": torch.empty(16, dtype=torch.float32), "N": inter, "K": hidden, "stride_xm": hidden,
            "stride_wn": hidden, "stride_rm": inter, "stride_om": inter, "stride_am": inter, "ACTIVATION": "gelu",
            "HAS_RESIDUAL": False, "HAS_ADDEND": True}, configs)
    pair_configs = _prune_pair_configs(_PAIR_CONFIGS, {"M": tokens, "x_ptr": t})
    gated = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "add_ptr": t, "out_ptr": t, "M": tokens, "N": inter, "K": hidden,
             "m_bucket": next_pow2(tokens), "stride_xm": hidden, "stride_xk": 1, "stride_wn": hidden, "stride_wk": 1,
             "stride_am": 0, "stride_om": inter, "stride_on": 1, "HAS_BIAS": False, "HAS_ADDEND": False,
             "INPUT_PRECISION": dot_precision(dtype)}
    yield ("linear_geglu", _linear_gated_kernel.fn, {**gated, "ACTIVATION": "gelu"}, pair_configs)
    yield ("linear_swiglu", _linear_gated_kernel.fn, {**gated, "ACTIVATION": "silu"}, pair_configs)
