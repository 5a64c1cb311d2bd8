"""GEMM with a fused epilogue: ``out = act(x @ weight.T + bias) (+ residual)``.

One kernel serves the FFN input projection (bias + GELU/ReLU), the output projections (bias +
residual add) and the pooler (bias + tanh). The main loop (`_gemm_tile`) is shared with the fused
QKV kernel; it accumulates in fp32 whatever the input dtype, and the epilogue applies bias,
activation and residual on the fp32 accumulator before a single rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation import IDS as ACTIVATIONS
from ._common import check_device, check_float, check_shape, configs_for_mode, dot_precision, next_pow2



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
    return acc


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Map the 1-D program id to a (pid_m, pid_n) tile, GROUP_M row-tiles at a time so that
    programs running together share weight tiles in L2."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, pid_m, pid_n,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               INPUT_PRECISION: tl.constexpr):
    """fp32 tile [BLOCK_M, BLOCK_N] of x[M, K] @ w[N, K].T, with its row and column offsets."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    return acc, offs_m, offs_n


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of this dtype's family that fit the problem (the autotuner's filter)."""
    m = named_args["M"]
    x = named_args["x_ptr"]
    family = FMA_CONFIGS if x.dtype == torch.float32 else MMA_CONFIGS
    kept = []
    for c in configs:
        if not any(c is f for f in family):
            continue
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        # Row tiles far taller than the token count only compute padding (b1 x s16 has M = 16).
        if bm > max(64, next_pow2(m)):
            continue
        # Software pipelining keeps `num_stages` x and w tiles in shared memory (A100: 164 KB).
        if c.num_stages * (bm + bn) * bk * x.element_size() > 160 * 1024:
            continue
        kept.append(c)
    return kept or [c for c in configs if any(c is f for f in family)][-1:] or [configs[-1]]


# fp16/bf16 (tensor cores). BERT GEMMs are M = tokens (16..16k) by N, K in {H, 3H, 4H} for
# H 384..1024: 128x128 tiles win from ~1k tokens on A100/H100, 64-row tiles keep small batches
# busy. 128x256 tiles spill once the GELU or residual epilogue holds the fp32 accumulator, and
# so do 128x128 tiles on 4 warps: `bertfast kernels` checks every config here.
MMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
]
# fp32 with input_precision="ieee" runs on the FMA units, operands in registers: small K steps,
# or the kernel spills heavily.
FMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2),
]
_CONFIGS = MMA_CONFIGS + FMA_CONFIGS
# Under the interpreter fewer, larger programs are faster (numpy does the tile work).
_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4},
                                    num_warps=4, num_stages=1)
CONFIGS = configs_for_mode(_CONFIGS, _INTERPRETER_CONFIG)


@triton.autotune(configs=CONFIGS, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=["M", "m_bucket"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, out_ptr,
    M, N, K, m_bucket,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # m_bucket (next power of two of M) keys the autotuner and M is not specialised on: a new token
    # count reuses its bucket's tuned config and never recompiles.
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                                     pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc += bias[None, :]
    acc = _apply_activation(acc, ACTIVATION)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask,
                      other=0.0)  # [BLOCK_M, BLOCK_N]
        acc += res.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias) + residual`` in one kernel, fp32 accumulation.

    x: (M, K); weight: (N, K) (the torch.nn.Linear layout); bias: (N,) or None; residual: (M, N)
    or None, added after the activation; activation in ACTIVATIONS. All the same float dtype and
    device; any strides. Returns (M, N) contiguous in x's dtype.
    """
    op = "linear"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
    check_float(op, "x", x, 2)
    check_float(op, "weight", weight, 2, x.dtype)
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"{op}: x is {tuple(x.shape)} but weight is {tuple(weight.shape)}; "
                         "weight must be (N, K) with K = x.shape[1]")
    tensors = [x, weight]
    if bias is not None:
        check_float(op, "bias", bias, 1, x.dtype)
        check_shape(op, "bias", bias, (N,))
        tensors.append(bias)
    if residual is not None:
        check_float(op, "residual", residual, 2, x.dtype)
        check_shape(op, "residual", residual, (M, N))
        tensors.append(residual)
    check_device(op, *tensors)
    if K == 0:
        raise ValueError(f"{op}: K = 0 (empty inner dimension) is not supported")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    res = residual if residual is not None else out  # never read when HAS_RESIDUAL is False
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _linear_kernel[grid](
        x, weight, bias if bias is not None else x, res, out,
        M, N, K, next_pow2(M),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), res.stride(0), res.stride(1),
        out.stride(0), out.stride(1),
        ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
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
    projection (bias + GELU) and an output projection (bias + residual), contiguous operands.
    Yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    inter = 4 * hidden
    configs = _prune_configs(_CONFIGS, {"M": tokens, "x_ptr": t})
    common = {"x_ptr": t, "w_ptr": t, "b_ptr": t, "res_ptr": t, "out_ptr": t, "M": tokens,
              "m_bucket": next_pow2(tokens), "stride_xk": 1, "stride_wk": 1, "stride_rn": 1, "stride_on": 1,
              "HAS_BIAS": True, "INPUT_PRECISION": dot_precision(dtype)}
    yield ("linear_gelu", _linear_kernel.fn,
           {**common, "N": inter, "K": hidden, "stride_xm": hidden, "stride_wn": hidden, "stride_rm": inter,
            "stride_om": inter, "ACTIVATION": "gelu", "HAS_RESIDUAL": False}, configs)
    yield ("linear_residual", _linear_kernel.fn,
           {**common, "N": hidden, "K": inter, "stride_xm": inter, "stride_wn": inter, "stride_rm": hidden,
            "stride_om": hidden, "ACTIVATION": "none", "HAS_RESIDUAL": True}, configs)
