"""Fused QKV projection: one GEMM ``x @ qkv_weight.T + qkv_bias`` whose epilogue scatters the
``3H`` output columns straight into three ``(T, heads, d)`` tensors, the layout attention reads.

Output column ``n`` of the fused ``[3H, H]`` weight belongs to tensor ``n // H`` (q, k, v), head
``(n % H) // d`` and channel ``n % d``; in a contiguous ``(T, heads, d)`` tensor that element sits
at ``t * H + n % H``, so the epilogue needs no per-head arithmetic, only the split into three
planes. No transpose or copy follows. The softmax scale can be folded into q here for free.

With rotary position embeddings (RoPE, half split over the whole head dim) the rotation is the epilogue too:
channel i < d/2 of a head is rotated with channel i + d/2 of the same head, so the rotary kernel tiles the
output by column *pairs*, (head, i) -> columns head*d + i and head*d + i + d/2, with one accumulator per
half (`_gemm_pair_tile`); both operands of the rotation then sit in the same register slot. The cos/sin
rows are the token's own (T, d/2) table rows, so positions follow the packed layout. v is not rotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (_CONFIGS, _PAIR_CONFIGS, CONFIGS, PAIR_CONFIGS, _gemm_pair_tile, _gemm_tile, _program_tile,
                      _prune_configs, _prune_pair_configs, check_device, check_float, check_shape, dot_precision,
                      next_pow2)
from .linear import _gemm_epilogue, epilogue_operands


@triton.autotune(configs=CONFIGS, key=["m_bucket", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=["M", "m_bucket", "q_scale"])
def _qkv_kernel(
    x_ptr, w_ptr, b_ptr, add_ptr, out_ptr,
    M, N, K, m_bucket, hidden, q_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_am,
    HAS_BIAS: tl.constexpr, SCALE_Q: tl.constexpr, HAS_ADDEND: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # out_ptr is a contiguous [3, M, hidden] buffer: planes q, k, v, each [M, heads, d].
    pid_m, pid_n = _program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = _gemm_tile(x_ptr, w_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                                     pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, b_ptr, 0, 0, out_ptr, 0, hidden, q_scale, add_ptr, stride_am,
                   "none", HAS_BIAS, False, True, SCALE_Q, HAS_ADDEND)


@triton.autotune(configs=PAIR_CONFIGS, key=["m_bucket", "P", "K", "HALF_DIM"],
                 prune_configs_by={"early_config_prune": _prune_pair_configs})
@triton.jit(do_not_specialize=["M", "m_bucket", "q_scale"])
def _qkv_rotary_kernel(
    x_ptr, w_ptr, b_ptr, add_ptr, cos_ptr, sin_ptr, out_ptr,
    M, P, K, m_bucket, hidden, q_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_am, stride_cm, stride_ci, stride_sm, stride_si,
    HALF_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_Q: tl.constexpr, HAS_ADDEND: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # P = 3H/2 column pairs; pair p is channel i = p % HALF_DIM of head slot p // HALF_DIM (of 3 x heads:
    # q, k, v) and owns fused columns n_a = slot * d + i and n_b = n_a + d/2. out_ptr as in _qkv_kernel.
    pid_m, pid_p = _program_tile(M, P, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_p = offs_p < P
    chan = offs_p % HALF_DIM
    n_a = (offs_p // HALF_DIM) * (2 * HALF_DIM) + chan
    n_b = n_a + HALF_DIM
    acc_a, acc_b = _gemm_pair_tile(x_ptr, w_ptr, K, stride_xm, stride_xk, stride_wn, stride_wk, offs_m, mask_m,
                                   n_a, n_b, mask_p, BLOCK_M, BLOCK_N, BLOCK_K, INPUT_PRECISION)
    if HAS_BIAS:
        bias_a = tl.load(b_ptr + n_a, mask=mask_p, other=0.0).to(tl.float32)  # [BLOCK_N]
        bias_b = tl.load(b_ptr + n_b, mask=mask_p, other=0.0).to(tl.float32)  # [BLOCK_N]
        acc_a += bias_a[None, :]
        acc_b += bias_b[None, :]
    if HAS_ADDEND:  # before the rotation, as the bias
        mask_ab = mask_m[:, None] & mask_p[None, :]
        add_row = add_ptr + offs_m.to(tl.int64)[:, None] * stride_am
        acc_a += tl.load(add_row + n_a[None, :], mask=mask_ab, other=0.0)  # [BLOCK_M, BLOCK_N] fp32
        acc_b += tl.load(add_row + n_b[None, :], mask=mask_ab, other=0.0)  # [BLOCK_M, BLOCK_N] fp32
    plane = n_a // hidden  # 0 = q, 1 = k, 2 = v
    # v's columns load cos = 1, sin = 0 (masked), which makes the rotation below exactly the identity.
    mask_rot = mask_m[:, None] & (mask_p & (plane < 2))[None, :]
    cos = tl.load(cos_ptr + offs_m[:, None] * stride_cm + chan[None, :] * stride_ci, mask=mask_rot,
                  other=1.0)  # [BLOCK_M, BLOCK_N] fp32
    sin = tl.load(sin_ptr + offs_m[:, None] * stride_sm + chan[None, :] * stride_si, mask=mask_rot,
                  other=0.0)  # [BLOCK_M, BLOCK_N] fp32
    y_a = acc_a * cos - acc_b * sin
    y_b = acc_b * cos + acc_a * sin
    if SCALE_Q:
        is_q = (plane == 0)[None, :]
        y_a = tl.where(is_q, y_a * q_scale, y_a)
        y_b = tl.where(is_q, y_b * q_scale, y_b)
    col_a = n_a - plane * hidden
    # int64: 3 * M * hidden passes 2^31 at ~700k tokens of BERT-large.
    offs_a = plane.to(tl.int64)[None, :] * M * hidden + offs_m.to(tl.int64)[:, None] * hidden + col_a[None, :]
    mask = mask_m[:, None] & mask_p[None, :]
    tl.store(out_ptr + offs_a, y_a.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + offs_a + HALF_DIM, y_b.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rotary(op: str, rotary, T: int, d: int):
    """(cos, sin), each (T, d/2) float32; returns them."""
    if not isinstance(rotary, tuple) or len(rotary) != 2:
        raise ValueError(f"{op}: rotary must be a (cos, sin) pair (e.g. backends.Rotary), got "
                         f"{type(rotary).__name__}")
    if d % 2:
        raise ValueError(f"{op}: rotary embeddings need an even head dim, got {d}")
    for name, t in zip(("cos", "sin"), rotary):
        if not torch.is_tensor(t) or t.dtype != torch.float32 or tuple(t.shape) != (T, d // 2):
            desc = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{op}: rotary {name} must be a float32 (T, d/2) = {(T, d // 2)} tensor, got {desc}")
    return rotary


def qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
        q_scale: float | None = None, rotary=None, addend: torch.Tensor | None = None):
    """Fused Q/K/V projection, optionally with rotary position embeddings on q and k.

    x: (T, H); weight: (3H, H), rows q | k | v; bias: (3H,) or None; all one float dtype and device.
    q_scale: if given, q is multiplied by it (e.g. 1/sqrt(d), so attention can use scale 1).
    rotary: None or (cos, sin) (e.g. `backends.Rotary`), each (T, d/2) float32 on x's device: q and k are
    rotated half-split (y[i] = x[i] cos - x[i + d/2] sin, y[i + d/2] = x[i + d/2] cos + x[i] sin) in fp32,
    then rounded once. addend: (T, 3H) float32 or None (LoRA deltas), added with the bias, before the rotation.
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
    d = H // num_heads
    tensors = [x, weight] + ([bias] if bias is not None else [])
    if rotary is not None:
        tensors += list(_check_rotary(op, rotary, T, d))
    tensors += epilogue_operands(op, x, None, None, T, 3 * H, addend)
    check_device(op, *tensors)
    out = torch.empty(3, T, num_heads, d, dtype=x.dtype, device=x.device)
    add = addend if addend is not None else x  # never read when HAS_ADDEND is False
    stride_am = add.stride(0) if addend is not None else 0
    if T > 0 and rotary is not None:
        cos, sin = rotary
        P = 3 * H // 2
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * triton.cdiv(P, meta["BLOCK_N"]),)  # noqa: E731
        _qkv_rotary_kernel[grid](
            x, weight, bias if bias is not None else x, add, cos, sin, out,
            T, P, H, next_pow2(T), H, 1.0 if q_scale is None else float(q_scale),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), stride_am, cos.stride(0), cos.stride(1),
            sin.stride(0), sin.stride(1),
            HALF_DIM=d // 2, HAS_BIAS=bias is not None, SCALE_Q=q_scale is not None, HAS_ADDEND=addend is not None,
            INPUT_PRECISION=dot_precision(x.dtype),
        )
    elif T > 0:
        N = 3 * H
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _qkv_kernel[grid](
            x, weight, bias if bias is not None else x, add, out,
            T, N, H, next_pow2(T), H, 1.0 if q_scale is None else float(q_scale),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), stride_am,
            HAS_BIAS=bias is not None, SCALE_Q=q_scale is not None, HAS_ADDEND=addend is not None,
            INPUT_PRECISION=dot_precision(x.dtype),
        )
    return out[0], out[1], out[2]


def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """Representative BERT-base fused QKV launches for `bertfast kernels`, plain (without and with LoRA terms) and
    rotary (no bias, d = 64, as ModernBERT-base): yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    configs = _prune_configs(_CONFIGS, {"M": tokens, "x_ptr": t})
    yield ("qkv", _qkv_kernel.fn,
           {"x_ptr": t, "w_ptr": t, "b_ptr": t, "add_ptr": t, "out_ptr": t, "M": tokens, "N": 3 * hidden,
            "K": hidden, "m_bucket": next_pow2(tokens), "hidden": hidden, "q_scale": 0.125, "stride_xm": hidden,
            "stride_xk": 1, "stride_wn": hidden, "stride_wk": 1, "stride_am": 0, "HAS_BIAS": True, "SCALE_Q": True,
            "HAS_ADDEND": False, "INPUT_PRECISION": dot_precision(dtype)}, configs)
    yield ("qkv_lora", _qkv_kernel.fn,  # with the rows' LoRA terms (`kernels.triton.lora`'s fp32 addend)
           {"x_ptr": t, "w_ptr": t, "b_ptr": t, "add_ptr": torch.empty(16, dtype=torch.float32), "out_ptr": t,
            "M": tokens, "N": 3 * hidden, "K": hidden, "m_bucket": next_pow2(tokens), "hidden": hidden,
            "q_scale": 0.125, "stride_xm": hidden, "stride_xk": 1, "stride_wn": hidden, "stride_wk": 1,
            "stride_am": 3 * hidden, "HAS_BIAS": True, "SCALE_Q": True, "HAS_ADDEND": True,
            "INPUT_PRECISION": dot_precision(dtype)}, configs)
    head_dim = 64
    yield ("qkv_rotary", _qkv_rotary_kernel.fn,
           {"x_ptr": t, "w_ptr": t, "b_ptr": t, "add_ptr": t, "cos_ptr": torch.empty(16, dtype=torch.float32),
            "sin_ptr": torch.empty(16, dtype=torch.float32), "out_ptr": t, "M": tokens, "P": 3 * hidden // 2,
            "K": hidden, "m_bucket": next_pow2(tokens), "hidden": hidden, "q_scale": 0.125, "stride_xm": hidden,
            "stride_xk": 1, "stride_wn": hidden, "stride_wk": 1, "stride_am": 0, "stride_cm": head_dim // 2,
            "stride_ci": 1, "stride_sm": head_dim // 2, "stride_si": 1, "HALF_DIM": head_dim // 2, "HAS_BIAS": False,
            "SCALE_Q": False, "HAS_ADDEND": False, "INPUT_PRECISION": dot_precision(dtype)},
           _prune_pair_configs(_PAIR_CONFIGS, {"M": tokens, "x_ptr": t}))
