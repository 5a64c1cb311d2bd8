"""Hopper GEMM with a fused epilogue: ``act(x @ weight.T + bias) (+ residual)`` (the contract of `linear.linear`) and
the fused QKV projection split into q, k, v planes (the contract of `qkv.qkv` without rotary), built from TMA tensor
descriptors (the operand tiles land in shared memory by `cp.async.bulk.tensor`, zero-filled past M, N and K), wgmma
(`tl.dot` on fp16/bf16 tiles of 64+ rows on whole warpgroups) and a persistent schedule (one program per SM, each
looping over output tiles in the grouped order of `_common._program_tile`).

Invariant: a row's output bits do not depend on its batch. The tile config is a function of the dtype and a tile name
the caller fixes per shape (no autotuning, no M buckets), and every output tile runs the same K loop, BLOCK_K at a time
from k = 0 up, into one fp32 accumulator: no split-K, no stream-K; which program runs a tile, and when, changes no
arithmetic. TMA needs 16-byte aligned rows: N and K multiples of 16 and unit stride along K, refused otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..activation import IDS as ACTIVATIONS
from ._common import _tile_of, check_device, check_float, check_shape, dot_precision
from .linear import _gemm_epilogue, epilogue_operands

# TMA loads rows that start on 16 bytes: N and K multiples of 16 keep every row of x, weight and out so in any dtype.
ALIGN = 16
# The tiles, by name; a call runs one of them whatever its token count (the invariant above). "plain": 128 x 128 on two
# warpgroups (a 64-register fp32 accumulator a thread), 4 stages of x and w tiles in shared memory, the tile loop
# flattened into the K loop so the next tile's loads overlap this one's epilogue. "ws": warp specialised (a producer
# warpgroup issuing TMA, two consumer warpgroups issuing wgmma: 12 warps), the only tile Triton 3.9's Hopper pass
# partitions (a 128-row tile fails in its TMA split). Which is faster per shape: `bertfast gpucheck --stages gemm`.
TILES = {
    "plain": triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "WARP_SPECIALIZE": False},
                           num_warps=8, num_stages=4),
    "ws": triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "WARP_SPECIALIZE": True},
                        num_warps=4, num_stages=4),
}
DEFAULT_TILE = "plain"
# fp32 runs exact ("ieee") dots on the FMA units, operands in registers: one small tile in K steps of 16 (of 32, or
# on 4 warps, ptxas needs 230-255 registers and spills on sm_90).
FMA_TILE = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16, "GROUP_M": 8, "WARP_SPECIALIZE": False},
                         num_warps=8, num_stages=2)
# Under the interpreter the GPU tiles are kept (the tests cross the real thresholds) and the persistent loop is made to
# run several tiles a program.
INTERPRETER_PROGRAMS = 3


@triton.jit(do_not_specialize=["M", "q_scale"])
def _linear_tma_kernel(
    x_desc, w_desc, b_ptr, res_ptr, out_ptr,
    M, N, K, hidden, q_scale, stride_rm, stride_rn,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT_QKV: tl.constexpr,
    SCALE_Q: tl.constexpr, INPUT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # x_desc: [M, K] in [BLOCK_M, BLOCK_K] boxes; w_desc: [N, K] in [BLOCK_N, BLOCK_K] boxes. out_ptr: a contiguous
    # [M, N], or with SPLIT_QKV the [3, M, hidden] planes q, k, v of qkv.py (N = 3 * hidden).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_programs = tl.num_programs(0)
    # The epilogue finds its tile from a counter of its own: in the flattened loop the pipeliner runs the next tile's
    # loads ahead of this tile's epilogue, and must not share one value between them (as Triton's persistent tutorial).
    tile_id_c = tl.program_id(0) - num_programs
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=not WARP_SPECIALIZE):
        pid_m, pid_n = _tile_of(tile_id, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, warp_specialize=WARP_SPECIALIZE):  # k = 0, BLOCK_K, ... in order, one accumulator
            x = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])  # [BLOCK_M, BLOCK_K]
            w = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])  # [BLOCK_N, BLOCK_K]
            acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)
        tile_id_c += num_programs
        pid_m, pid_n = _tile_of(tile_id_c, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, res_ptr, stride_rm, stride_rn, out_ptr, N, hidden, q_scale,
                       b_ptr, 0, ACTIVATION, HAS_BIAS, HAS_RESIDUAL, SPLIT_QKV, SCALE_Q, False)


def config_for(dtype: torch.dtype, tile: str = DEFAULT_TILE) -> triton.Config:
    """The config of a named tile in a dtype (fp32 has one): a function of neither shape nor token count."""
    if tile not in TILES:
        raise ValueError(f"unknown TMA tile {tile!r} (expected one of {', '.join(TILES)})")
    return FMA_TILE if dtype == torch.float32 else TILES[tile]


def _check_tma(op: str, x, weight, N: int, K: int) -> None:
    """What TMA descriptors need: N and K multiples of ALIGN, unit stride along K, 16-byte aligned rows and bases, and
    a device that has TMA (Hopper, sm_90, or later); raises ValueError naming the first that fails."""
    if K == 0:
        raise ValueError(f"{op}: K = 0 (empty inner dimension) is not supported")
    if N % ALIGN or K % ALIGN:
        raise ValueError(f"{op}: the TMA kernel needs N and K multiples of {ALIGN}, got N = {N}, K = {K} "
                         "(use linear.linear / qkv.qkv for other shapes)")
    for name, t in (("x", x), ("weight", weight)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{op}: {name} must have unit stride along K and 16-byte aligned rows for TMA, got "
                             f"strides {tuple(t.stride())}, base {t.data_ptr() % 16} bytes past a 16-byte boundary")
    if x.device.type == "cuda" and _gpu(x.device)[0] < 9:
        raise ValueError(f"{op}: the TMA kernel needs a Hopper GPU (sm_90) or later, got "
                         f"{torch.cuda.get_device_name(x.device)} (use linear.linear / qkv.qkv)")


@functools.lru_cache(maxsize=None)
def _gpu_of_index(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


def _gpu(device: torch.device) -> tuple[int, int]:
    """(compute capability major, SM count) of a CUDA device, read once per device."""
    return _gpu_of_index(device.index if device.index is not None else torch.cuda.current_device())


def _num_programs(device: torch.device, tiles: int) -> int:
    """The persistent grid: one program per SM (INTERPRETER_PROGRAMS on CPU), never more than there are tiles."""
    sms = _gpu(device)[1] if device.type == "cuda" else INTERPRETER_PROGRAMS
    return max(1, min(sms, tiles))


def _launch(x, weight, bias, res, out, M, N, K, hidden, q_scale, tile, **flags):
    config = config_for(x.dtype, tile)
    bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [bm, bk])
    w_desc = TensorDescriptor(weight, [N, K], [weight.stride(0), 1], [bn, bk])
    grid = (_num_programs(x.device, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _linear_tma_kernel[grid](
        x_desc, w_desc, bias if bias is not None else x, res, out,
        M, N, K, hidden, q_scale, res.stride(0), res.stride(1),
        HAS_BIAS=bias is not None, INPUT_PRECISION=dot_precision(x.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages, **config.kwargs, **flags,
    )


def _check_weights(op: str, x, weight, bias, n_rows: int | None = None):
    check_float(op, "x", x, 2)
    check_float(op, "weight", weight, 2, x.dtype)
    M, K = x.shape
    if weight.shape[1] != K or (n_rows is not None and weight.shape[0] != n_rows):
        raise ValueError(f"{op}: x is {tuple(x.shape)} but weight is {tuple(weight.shape)}; weight must be "
                         f"({n_rows if n_rows is not None else 'N'}, K) with K = x.shape[1]")
    if bias is not None:
        check_float(op, "bias", bias, 1, x.dtype)
        check_shape(op, "bias", bias, (weight.shape[0],))
    return M, weight.shape[0], K


def linear_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
               residual: torch.Tensor | None = None, tile: str = DEFAULT_TILE) -> torch.Tensor:
    """``act(x @ weight.T + bias) + residual`` by the Hopper TMA kernel, fp32 accumulation, one rounding.

    x: (M, K), unit stride along K; weight: (N, K); bias: (N,) or None; residual: (M, N) or None (any strides), added
    after the activation; activation in ACTIVATIONS; one float dtype and device; N, K multiples of 16; tile a name in
    TILES. Returns (M, N) contiguous in x's dtype, each row the same bits in any batch (for one tile).
    """
    op = "linear_tma"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r} (expected one of {', '.join(ACTIVATIONS)})")
    M, N, K = _check_weights(op, x, weight, bias)
    check_device(op, x, weight, *epilogue_operands(op, x, bias, residual, M, N))
    _check_tma(op, x, weight, N, K)
    config_for(x.dtype, tile)  # an unknown tile raises before anything is allocated
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    _launch(x, weight, bias, residual if residual is not None else out, out, M, N, K, N, 1.0, tile,
            ACTIVATION=activation, HAS_RESIDUAL=residual is not None, SPLIT_QKV=False, SCALE_Q=False)
    return out


def qkv_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
            q_scale: float | None = None, tile: str = DEFAULT_TILE):
    """The fused Q/K/V projection of `qkv.qkv` (no rotary) by the Hopper TMA kernel.

    x: (T, H), unit stride along H, H a multiple of 16; weight: (3H, H), rows q | k | v; bias: (3H,) or None; one
    float dtype and device; tile a name in TILES. q_scale: if given, q is multiplied by it. Returns q, k, v: each
    (T, heads, d) contiguous, d = H // num_heads, views of one buffer.
    """
    op = "qkv_tma"
    check_float(op, "x", x, 2)
    T, H = x.shape
    if not isinstance(num_heads, int) or num_heads <= 0 or H == 0 or H % num_heads:
        raise ValueError(f"{op}: num_heads = {num_heads!r} must be a positive int dividing hidden {H}")
    _check_weights(op, x, weight, bias, 3 * H)
    check_device(op, *([x, weight] + ([bias] if bias is not None else [])))
    _check_tma(op, x, weight, 3 * H, H)
    config_for(x.dtype, tile)  # an unknown tile raises before anything is allocated
    out = torch.empty(3, T, num_heads, H // num_heads, dtype=x.dtype, device=x.device)
    if T > 0:
        _launch(x, weight, bias, x, out, T, 3 * H, H, H, 1.0 if q_scale is None else float(q_scale), tile,
                ACTIVATION="none", HAS_RESIDUAL=False, SPLIT_QKV=True, SCALE_Q=q_scale is not None)
    return out[0], out[1], out[2]


# `bertfast kernels` builds this module for sm_90 and later only: TMA and wgmma are Hopper's.
AOT_MIN_ARCH = 90


def aot_variants(dtype: torch.dtype = torch.float16, tokens: int = 1024, hidden: int = 768):
    """Representative BERT-base launches for `bertfast kernels` (AOT_MIN_ARCH and later), each tile: the FFN input
    projection (bias + GELU), an output projection (bias + residual) and the fused QKV (bias, q scaled), named with
    the tile ("_ws") but for the default one. Yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    inter = 4 * hidden
    common = {"b_ptr": t, "res_ptr": t, "out_ptr": t, "M": tokens, "q_scale": 1.0, "stride_rn": 1, "HAS_BIAS": True,
              "SCALE_Q": False, "INPUT_PRECISION": dot_precision(dtype)}
    linear = {"ACTIVATION": "none", "HAS_RESIDUAL": False, "SPLIT_QKV": False}
    shapes = [("linear_tma_gelu", inter, hidden, {**linear, "hidden": inter, "ACTIVATION": "gelu"}),
              ("linear_tma_residual", hidden, inter, {**linear, "hidden": hidden, "HAS_RESIDUAL": True}),
              ("qkv_tma", 3 * hidden, hidden, {**linear, "hidden": hidden, "SPLIT_QKV": True, "SCALE_Q": True,
                                               "q_scale": 0.125})]
    for tile in TILES if dtype != torch.float32 else [DEFAULT_TILE]:
        config = config_for(dtype, tile)
        bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
        for name, n, k, flags in shapes:
            # Only the descriptors' dtype and box reach the kernel's signature, not their base or shape.
            x_desc = TensorDescriptor(t.view(1, 16), [tokens, k], [k, 1], [bm, bk])
            w_desc = TensorDescriptor(t.view(1, 16), [n, k], [k, 1], [bn, bk])
            yield (name if tile == DEFAULT_TILE else f"{name}_{tile}", _linear_tma_kernel,
                   {**common, "x_desc": x_desc, "w_desc": w_desc, "N": n, "K": k, "stride_rm": n, **flags}, [config])
