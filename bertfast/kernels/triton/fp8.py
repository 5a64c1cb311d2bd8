"""fp8 (e4m3) GEMMs: per-row dynamic quantization of the activations and one GEMM kernel whose epilogue dequantizes.

A (M, K) activation is quantized row by row (`quantize_rows`): scale = amax / 448, codes = e4m3(x * 448 / amax) rounded
to nearest even and saturated at +-448; the (N, K) weights are quantized the same way once, per output channel
(`quantize_weight`). The GEMM (`linear`, `qkv`) multiplies codes with `tl.dot` on float8e4nv operands, fp32
accumulation, and its epilogue computes ``acc * x_scale[m] * w_scale[n]``, then bias, activation and residual (or the
q/k/v split) as the fp16 kernels of linear.py and qkv.py do. Every config has the same BLOCK_K and a row's scale is
its own, so a row's result does not depend on its batch (same bits alone or inside any batch).

The codes are computed with integer arithmetic on the fp32 bits, not with a cast to float8e4nv: the Triton
interpreter's cast rounds ties away from zero and wraps past 448, so the same code then runs, bit for bit, on the GPU
and under the interpreter. Needs sm_89 or later (Ada, Hopper) on CUDA: `check_arch`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..activation import IDS as ACTIVATIONS
from ._common import INTERPRET, _program_tile, check_device, check_shape, configs_for_mode, next_pow2
from .linear import _gemm_epilogue

AOT_MIN_ARCH = 89  # `bertfast kernels` builds these variants only for sm_89 / sm_90: fp8 tensor cores
E4M3_MAX = tl.constexpr(448.0)  # a jit function reads it: a constexpr, or the compiler refuses the global
CODE_DTYPE = torch.float8_e4m3fn  # Triton's float8e4nv
ACTIVATION_DTYPES = (torch.float16, torch.float32)  # bf16 too on CUDA (the interpreter computes no bf16)


class Fp8Weight(NamedTuple):
    """A (N, K) weight quantized per output channel (`quantize_weight`): weight[n] ~ codes[n] * scales[n].

    codes: (N, K) float8_e4m3fn contiguous; scales: (N,) float32."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self):
        return self.codes.shape


def check_arch(device) -> None:
    """Raise ValueError where `device` is a CUDA GPU without fp8 tensor cores (compute capability below 8.9)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"fp8 (e4m3) needs a GPU of compute capability 8.9 or later (Ada, Hopper); {name} has "
                         f"{major}.{minor} (sm_{major}{minor}): use dtype='fp16' or 'bf16' there")


# ---- quantization ----


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, M, K, stride_xm, stride_xk,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # codes_ptr: (M, K) uint8 contiguous (the bits of e4m3 codes); scales_ptr: (M,) fp32.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask,
                other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.where(amax > 0, amax, E4M3_MAX)  # a zero row: scale 1, codes 0
    scale = tl.math.div_rn(amax, E4M3_MAX)  # IEEE division: `/` is approximate on the GPU
    y = x * tl.math.div_rn(E4M3_MAX, amax)[:, None]
    a = tl.minimum(tl.abs(y), E4M3_MAX)  # the row's amax lands within an ulp of 448: saturate
    bits = a.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits, ties to even (the carry may step the exponent), rebias 127 -> 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Below 2^-6 the codes are multiples of 2^-9: round a * 2^9 to an integer by adding 2^23 (exact, ties to even).
    subnormal = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0.015625, subnormal, normal) | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)
    tl.store(codes_ptr + offs_m[:, None] * K + offs_k[None, :], code.to(tl.uint8), mask=mask)
    tl.store(scales_ptr + offs_m, scale, mask=mask_m)


def _quantize_blocks(K: int, interpret: bool = INTERPRET) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the quantize kernel: whole rows, a few per program (64 under the interpreter)."""
    block_k = next_pow2(max(K, 16))
    return (64 if interpret else max(1, min(16, 4096 // block_k))), block_k


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric e4m3 quantization: x[m] ~ codes[m] * scales[m], scales[m] = amax(|x[m]|) / 448.

    x: (M, K) float16 or float32 (bfloat16 on CUDA), any strides, finite. Returns codes (M, K) float8_e4m3fn
    contiguous, equal bit for bit to ``(x.float() * (448 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn)``, and
    scales (M,) float32 (1.0 for a zero row)."""
    op = "fp8.quantize_rows"
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    allowed = ACTIVATION_DTYPES + ((torch.bfloat16,) if x.device.type == "cuda" else ())
    if x.dtype not in allowed:
        raise ValueError(f"{op}: x has dtype {x.dtype}; supported on {x.device.type}: "
                         + ", ".join(str(d).replace("torch.", "") for d in allowed))
    check_device(op, x)
    M, K = x.shape
    if K == 0 or K > 16384:
        raise ValueError(f"{op}: rows of K = {K} are not supported (1 to 16384: one program holds whole rows)")
    codes = torch.empty(M, K, dtype=CODE_DTYPE, device=x.device)
    scales = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return codes, scales
    block_m, block_k = _quantize_blocks(K)
    _quantize_rows_kernel[(triton.cdiv(M, block_m),)](
        x, codes.view(torch.uint8), scales, M, K, x.stride(0), x.stride(1), BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=4)
    return codes, scales


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """A (N, K) float weight (the torch.nn.Linear layout) quantized per output channel, once at load."""
    check_arch(weight.device)
    return Fp8Weight(*quantize_rows(weight))


# ---- the GEMM ----

# fp8 operands take half the bytes of fp16 ones: the fp16 tiles (_common.MMA_CONFIGS) with BLOCK_K doubled, the same
# shared memory per stage (sm_89 has ~100 KB). Untimed on a GPU. BLOCK_K is the same in every config (and the
# interpreter's), so every M bucket sums K in the same order: batch invariance.
BLOCK_K_FP8 = 128
_CONFIGS_FP8 = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 8}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 8}, num_warps=4, num_stages=4),
]
CONFIGS_FP8 = configs_for_mode(_CONFIGS_FP8, triton.Config(
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": BLOCK_K_FP8, "GROUP_M": 4}, num_warps=4, num_stages=1))


def _prune_fp8_configs(configs, named_args, **kwargs):
    """Row tiles no taller than the token count needs (at least 64), and stages that fit 96 KB of shared memory."""
    m = named_args["M"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, next_pow2(m))
            and c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] <= 96 * 1024]
    return kept or configs[-1:]


@triton.autotune(configs=CONFIGS_FP8, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_fp8_configs})
@triton.jit(do_not_specialize=["M", "m_bucket", "q_scale"])
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, res_ptr, out_ptr,
    M, N, K, m_bucket, hidden, q_scale,
    stride_xm, stride_wn, stride_rm, stride_rn,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT_QKV: tl.constexpr,
    SCALE_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # x_ptr, w_ptr: e4m3 codes (M, K), (N, K), unit stride along K. SPLIT_QKV: out_ptr is a contiguous
    # [3, M, hidden] buffer (planes q, k, v) as in qkv._qkv_kernel; otherwise (M, N) contiguous.
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K] e4m3
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] e4m3
        # Hopper's fp8 MMA accumulates with fewer bits than fp32: promote into `acc` after every tile.
        acc = tl.dot(x, w, acc, max_num_imprecise_acc=BLOCK_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M] fp32
    w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N] fp32
    acc = acc * x_scale[:, None] * w_scale[None, :]
    _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, res_ptr, stride_rm, stride_rn, out_ptr, N, hidden, q_scale,
                   b_ptr, 0, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SPLIT_QKV, SCALE_Q, False)


def _check_gemm(op: str, x, weight, bias, n_rows: int | None = None):
    """x (M, K) float; weight an Fp8Weight of (N, K) (N = n_rows when given); bias (N,) in x's dtype or None.
    Returns M, N, K."""
    if not isinstance(weight, Fp8Weight):
        raise ValueError(f"{op}: weight must be an Fp8Weight (fp8.quantize_weight), got {type(weight).__name__}")
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    M, K = x.shape
    N = weight.codes.shape[0]
    if weight.codes.dtype != CODE_DTYPE or weight.codes.dim() != 2 or weight.codes.shape[1] != K \
            or weight.codes.stride(1) != 1:
        raise ValueError(f"{op}: weight codes must be (N, K = {K}) float8_e4m3fn with unit stride along K, got "
                         f"{weight.codes.dtype} {tuple(weight.codes.shape)}")
    if n_rows is not None and N != n_rows:
        raise ValueError(f"{op}: weight has {N} rows, expected {n_rows}")
    check_shape(op, "weight scales", weight.scales, (N,))
    if weight.scales.dtype != torch.float32:
        raise ValueError(f"{op}: weight scales must be float32, got {weight.scales.dtype}")
    if bias is not None:
        check_shape(op, "bias", bias, (N,))
        if bias.dtype != x.dtype:
            raise ValueError(f"{op}: bias has dtype {bias.dtype} but x is {x.dtype}; all must match")
    check_device(op, x, weight.codes, weight.scales, *([bias] if bias is not None else []))
    return M, N, K


def _launch(x, weight: Fp8Weight, bias, residual, out, N: int, activation="none", hidden=0, q_scale=None):
    """Quantize x's rows, then one GEMM launch writing `out` ((M, N), or the [3, M, hidden] q/k/v planes)."""
    M, K = x.shape
    codes, scales = quantize_rows(x)
    res = residual if residual is not None else x  # never read when HAS_RESIDUAL is False
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _fp8_linear_kernel[grid](
        codes, scales, weight.codes, weight.scales, bias if bias is not None else scales, res, out,
        M, N, K, next_pow2(M), hidden, 1.0 if q_scale is None else float(q_scale),
        codes.stride(0), weight.codes.stride(0), res.stride(0), res.stride(1),
        ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        SPLIT_QKV=hidden > 0, SCALE_Q=q_scale is not None,
    )


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None, activation: str = "none",
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x @ w.T + bias) + residual`` on e4m3 operands: x quantized per row here, w per output channel
    (`quantize_weight`); fp32 accumulation, dequantized in the epilogue, which then runs as linear.linear's.

    x: (M, K) float16 or float32 (bfloat16 on CUDA), any strides; weight: Fp8Weight of (N, K); bias: (N,) in x's
    dtype or None; residual: (M, N) in x's dtype or None, added after the activation. Returns (M, N) contiguous in
    x's dtype."""
    op = "fp8.linear"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
    M, N, K = _check_gemm(op, x, weight, bias)
    if residual is not None:
        check_shape(op, "residual", residual, (M, N))
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual has dtype {residual.dtype} but x is {x.dtype}; all must match")
        check_device(op, x, residual)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        _launch(x, weight, bias, residual, out, N, activation=activation)
    return out


def qkv(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None, num_heads: int,
        q_scale: float | None = None):
    """The fused Q/K/V projection (qkv.qkv without rotary) on e4m3 operands, as `linear`.

    x: (T, H) float16 or float32 (bfloat16 on CUDA); weight: Fp8Weight of (3H, H), rows q | k | v; bias: (3H,) or
    None; q_scale: if given, q is multiplied by it. Returns q, k, v: each (T, heads, d) contiguous, views of one
    buffer."""
    op = "fp8.qkv"
    if not torch.is_tensor(x) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    T, H = x.shape
    if not isinstance(num_heads, int) or num_heads <= 0 or H == 0 or H % num_heads:
        raise ValueError(f"{op}: num_heads = {num_heads!r} must be a positive int dividing hidden {H}")
    _check_gemm(op, x, weight, bias, 3 * H)
    out = torch.empty(3, T, num_heads, H // num_heads, dtype=x.dtype, device=x.device)
    if T:
        _launch(x, weight, bias, None, out, 3 * H, hidden=H, q_scale=q_scale)
    return out[0], out[1], out[2]


def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """Representative BERT-base fp8 launches for `bertfast kernels` (sm_89 and later: AOT_MIN_ARCH): the row
    quantizer (K = H and 4H), the FFN input projection (bias + GELU), an output projection (bias + residual) and the
    fused QKV; `dtype` is the activations' (fp16 or bf16). Yields (name, jit_fn, {argument: value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    c = torch.empty(16, dtype=CODE_DTYPE)
    f = torch.empty(16, dtype=torch.float32)
    inter = 4 * hidden
    for name, K in (("fp8_quantize", hidden), ("fp8_quantize_4h", inter)):
        block_m, block_k = _quantize_blocks(K, interpret=False)
        yield (name, _quantize_rows_kernel,
               {"x_ptr": t, "codes_ptr": torch.empty(16, dtype=torch.uint8), "scales_ptr": f, "M": tokens, "K": K,
                "stride_xm": K, "stride_xk": 1},
               [triton.Config({"BLOCK_M": block_m, "BLOCK_K": block_k}, num_warps=4, num_stages=1)])
    configs = _prune_fp8_configs(_CONFIGS_FP8, {"M": tokens})
    common = {"x_ptr": c, "xs_ptr": f, "w_ptr": c, "ws_ptr": f, "b_ptr": t, "res_ptr": t, "out_ptr": t, "M": tokens,
              "m_bucket": next_pow2(tokens), "q_scale": 1.0, "stride_rn": 1, "HAS_BIAS": True, "SCALE_Q": False}
    yield ("fp8_linear_gelu", _fp8_linear_kernel.fn,
           {**common, "N": inter, "K": hidden, "hidden": 0, "stride_xm": hidden, "stride_wn": hidden,
            "stride_rm": inter, "ACTIVATION": "gelu", "HAS_RESIDUAL": False,
            "SPLIT_QKV": False}, configs)
    yield ("fp8_linear_residual", _fp8_linear_kernel.fn,
           {**common, "N": hidden, "K": inter, "hidden": 0, "stride_xm": inter, "stride_wn": inter,
            "stride_rm": hidden, "ACTIVATION": "none", "HAS_RESIDUAL": True,
            "SPLIT_QKV": False}, configs)
    yield ("fp8_qkv", _fp8_linear_kernel.fn,
           {**common, "N": 3 * hidden, "K": hidden, "hidden": hidden, "q_scale": 0.125, "stride_xm": hidden,
            "stride_wn": hidden, "stride_rm": hidden, "ACTIVATION": "none",
            "HAS_RESIDUAL": False, "SPLIT_QKV": True, "SCALE_Q": True}, configs)
