"""Hopper attention for packed variable-length BERT sequences, the FlashAttention-3 way: Q, K and V tiles land in shared
memory by TMA (descriptors over the (T, heads * d) planes), wgmma computes both dots, and the K/V loop is pipelined:
by software (K/V tiles of the next steps in flight, the "plain" tile) or by warp specialization (a producer warpgroup
issuing the TMA loads for two consumer warpgroups, the "ws" tile). The plain BERT case only: head_dim 64 or 128,
fp16/bf16, no bias, no window, no mask beyond `cu_seqlens`; the contract and semantics of `attention.attention_varlen`
for that case.

Invariant: a row's output bits do not depend on its batch, and equal `attention._attention_block`'s: the same online
softmax in the same order (log2 units, exp2, the running max and sum updated as there, p rounded to the input dtype
before the PV dot), keys BLOCK_N = 64 at a time from key 0 up, and a tile config that is a function of (head_dim,
dtype, tile name) only. A TMA box runs past a sequence's end into the next sequence's rows (or the zero fill past T):
those keys get a -inf score (p = 0 exactly) and those query rows are never stored. Their V rows still enter the PV dot,
times p = 0: finite values add nothing, but a non-finite V in the next sequence would reach this one's rows, where
`_attention_block` loads zeros instead.

Grid: plain, one program per (sequence, head, BLOCK_M query rows), as `attention_varlen`'s. A persistent loop would
need the (sequence, query tile) pairs numbered on the device (a prefix sum over `cu_seqlens`) or a host copy, for
little: BERT sequences are short (<= 512 tokens, <= 4 query tiles per (sequence, head)) and programs past a
sequence's end exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .attention import MMA_CONFIGS, _check_qkv, check_varlen, check_varlen_values
from ._common import check_device

# Where the key step comes from: `_attention_block`'s tensor-core family steps 64 keys at a time, and a row's bits
# depend on that step (the running max and the rounding of p are taken per step).
BLOCK_N = MMA_CONFIGS[0].kwargs["BLOCK_N"]
HEAD_DIMS = (64, 128)
# TMA reads rows that start on 16 bytes.
ALIGN_BYTES = 16
# The tiles, by name, per head dim (fp16 and bf16 share them); a call runs one whatever its batch (the invariant above).
# "plain": 128 query rows on two warpgroups (8 warps), the K/V loop software-pipelined by `num_stages` (K and V
# tiles in flight while the dots of the step before run). "ws": warp specialised, as FA3: a producer warpgroup issues
# the TMA loads and two consumer warpgroups of 64 query rows each run the dots and the softmax (12 warps; `num_warps`
# is the producer's). Which is faster: not measured yet (docs/gpu-small-calls.md).
TILES = {
    "plain": {
        64: triton.Config({"BLOCK_M": 128, "BLOCK_N": BLOCK_N, "WARP_SPECIALIZE": False}, num_warps=8, num_stages=3),
        128: triton.Config({"BLOCK_M": 128, "BLOCK_N": BLOCK_N, "WARP_SPECIALIZE": False}, num_warps=8, num_stages=2),
    },
    "ws": {
        64: triton.Config({"BLOCK_M": 128, "BLOCK_N": BLOCK_N, "WARP_SPECIALIZE": True}, num_warps=4, num_stages=3),
        128: triton.Config({"BLOCK_M": 128, "BLOCK_N": BLOCK_N, "WARP_SPECIALIZE": True}, num_warps=4, num_stages=2),
    },
}
DEFAULT_TILE = "plain"


@triton.jit(do_not_specialize=["total_tokens", "scale_log2"])
def _attention_tma_kernel(
    q_arg, k_desc, v_desc, o_ptr, cu_seqlens_ptr, total_tokens, num_heads, scale_log2, stride_qs, stride_os,
    HEAD_DIM: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # k_desc, v_desc (and q_arg but with WARP_SPECIALIZE): descriptors of the (total_tokens, heads * HEAD_DIM) planes,
    # boxes [BLOCK_N or BLOCK_M, HEAD_DIM]; head h is the column block h * HEAD_DIM. With WARP_SPECIALIZE q_arg is the
    # plane's pointer (rows stride_qs apart). o_ptr: (total_tokens, heads, HEAD_DIM), rows stride_os apart.
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    seq_start = tl.load(cu_seqlens_ptr + b)
    seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
    if pid_m * BLOCK_M < seq_len:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        col = h * HEAD_DIM
        if WARP_SPECIALIZE:
            # Triton 3.9's Hopper pass splits the Q load between its two consumer warpgroups, and can re-box only a
            # descriptor made in the kernel (a host one fails in its TMA split).
            q_desc = tl.make_tensor_descriptor(q_arg, shape=[total_tokens, num_heads * HEAD_DIM],
                                               strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
        else:
            q_desc = q_arg
        # Rows past the sequence's end are the next sequence's (or zeros past T): computed, never stored.
        q = q_desc.load([seq_start + pid_m * BLOCK_M, col])  # [BLOCK_M, HEAD_DIM]
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for start_n in tl.range(0, seq_len, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            k = k_desc.load([seq_start + start_n, col])  # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, k.T) * scale_log2  # [BLOCK_M, BLOCK_N]
            # Keys past the end belong to another sequence (or are TMA's zeros): -inf, as `_attention_block` gives
            # its out-of-range keys, so p = 0 there and every tile still holds an in-range key (m_new finite).
            s = tl.where((start_n + offs_n < seq_len)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v_desc.load([seq_start + start_n, col])  # [BLOCK_N, HEAD_DIM]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        acc = acc / l_i[:, None]
        # int64: the packed row offset times its stride passes 2^31 for long packed batches.
        rows = (seq_start.to(tl.int64) + offs_m) * stride_os
        tl.store(o_ptr + rows[:, None] + col + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(offs_m < seq_len)[:, None])


def config_for(head_dim: int, dtype: torch.dtype, tile: str = DEFAULT_TILE) -> triton.Config:
    """The config of a named tile for a head dim in a dtype: a function of nothing else (not the batch, not the longest
    sequence)."""
    if tile not in TILES:
        raise ValueError(f"attention_tma: unknown tile {tile!r} (expected one of {', '.join(TILES)})")
    if head_dim not in HEAD_DIMS or dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"attention_tma: no tile for head_dim {head_dim} in {dtype} (head_dim 64 or 128, fp16 or "
                         "bf16)")
    return TILES[tile][head_dim]


def _scratch(size: int, alignment: int, stream):
    """Global memory for the descriptors a kernel makes on the device (the "ws" tile's Q descriptor)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Give Triton an allocator for device-made descriptors where this thread has none; one set by the caller stays."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def check_arch(device) -> None:
    """Raise ValueError where `device` is a CUDA GPU without TMA and wgmma (compute capability below 9.0, Hopper)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ValueError(f"attention_tma needs a Hopper GPU (sm_90) or later for TMA and wgmma; "
                         f"{torch.cuda.get_device_name(device)} has {major}.{minor} (sm_{major}{minor}): use "
                         "attention.attention_varlen there")


def _check_tma(op: str, name: str, t: torch.Tensor) -> None:
    """t (T, heads, d) is a (T, heads * d) plane TMA can read: unit stride along d, heads d apart, 16-byte aligned rows
    and base."""
    T, heads, d = t.shape
    plane = t.stride(2) == 1 and (t.stride(1) == d or heads == 1)
    if not plane or (t.stride(0) * t.element_size()) % ALIGN_BYTES or t.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{op}: {name} must be a (T, heads * d) plane for TMA (strides (row, d, 1) with 16-byte "
                         f"aligned rows and base), got strides {tuple(t.stride())}, base "
                         f"{t.data_ptr() % ALIGN_BYTES} bytes past a 16-byte boundary")


def attention_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                  scale: float, validate: bool = True, window: int = 0, bias=None,
                  tile: str = DEFAULT_TILE) -> torch.Tensor:
    """`attention.attention_varlen` for the plain BERT case, by the Hopper TMA kernel.

    q, k, v: (T, heads, d), d 64 or 128, fp16 or bf16 (fp16 under the interpreter), each a (T, heads * d) plane (unit
    stride along d, heads d apart, rows and base 16-byte aligned: the QKV kernel's planes or column blocks of a fused
    projection); cu_seqlens: (B+1,) int32, cu_seqlens[0] = 0, non-decreasing, cu_seqlens[-1] = T; max_seqlen: int >=
    the longest sequence; window and bias: only 0 and None (use attention_varlen for the others); tile: a name in TILES.
    Returns (T, heads * d) in q's dtype, each row the bits of `_attention_block`'s arithmetic, whatever its batch.
    validate=False skips the checks of cu_seqlens' values (a device-to-host copy), as attention_varlen's.
    """
    op = "attention_tma"
    if bias is not None:
        raise ValueError(f"{op}: a position bias is not supported (use attention.attention_varlen)")
    if isinstance(window, bool) or not isinstance(window, int) or window != 0:
        raise ValueError(f"{op}: only window = 0 (none) is supported, got {window!r} (use attention.attention_varlen)")
    _check_qkv(op, q, k, v, 3)
    T, heads, d = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{op}: fp16 or bf16 inputs only (tensor cores), got {q.dtype} (use attention_varlen)")
    if d not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {HEAD_DIMS}, got {d} (use attention.attention_varlen)")
    check_varlen(op, cu_seqlens, max_seqlen)
    check_device(op, q, k, v, cu_seqlens)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tma(op, name, t)
    check_arch(q.device)
    if validate:
        check_varlen_values(op, cu_seqlens, max_seqlen, T)
    config = config_for(d, q.dtype, tile)
    out = torch.empty(T, heads, d, dtype=q.dtype, device=q.device)
    batch = cu_seqlens.numel() - 1
    if T > 0 and batch > 0 and heads > 0 and max_seqlen > 0:
        bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
        # Only the box and the plane's extent (rows past T read as zeros) reach the kernel, not the sequences.
        k_desc, v_desc = (TensorDescriptor(t, [T, heads * d], [t.stride(0), 1], [bn, d]) for t in (k, v))
        q_arg = q
        if not config.kwargs["WARP_SPECIALIZE"]:
            q_arg = TensorDescriptor(q, [T, heads * d], [q.stride(0), 1], [bm, d])
        elif q.device.type == "cuda":
            _ensure_allocator()
        grid = (batch * heads, triton.cdiv(max_seqlen, bm))
        _attention_tma_kernel[grid](
            q_arg, k_desc, v_desc, out, cu_seqlens, T, heads, float(scale) * 1.4426950408889634, q.stride(0),
            out.stride(0), HEAD_DIM=d, num_warps=config.num_warps, num_stages=config.num_stages, **config.kwargs,
        )
    return out.view(T, heads * d)


# `bertfast kernels` builds this module for sm_90 and later only: TMA and wgmma are Hopper's.
AOT_MIN_ARCH = 90


def aot_variants(dtype: torch.dtype = torch.float16, heads: int = 12, tokens: int = 1024):
    """Representative BERT launches for `bertfast kernels` (AOT_MIN_ARCH and later): the packed (T, heads * d) planes
    of the QKV kernel, head_dim 64 (BERT-base) and 128, each tile, named with the head dim but for 64 and with the tile
    but for the default one; none in fp32, which this kernel refuses. Yields (name, jit_fn, {argument: representative
    value}, configs)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    for tile in TILES:
        for d in HEAD_DIMS:
            config = config_for(d, dtype, tile)
            hidden = heads * d
            bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
            # Only the descriptors' dtype and box reach the kernel's signature, not their base or shape.
            k_desc, v_desc, q_desc = (TensorDescriptor(t.view(1, 16), [tokens, hidden], [hidden, 1], [rows, d])
                                      for rows in (bn, bn, bm))
            name = "attention_tma" + ("" if d == 64 else f"_d{d}") + ("" if tile == DEFAULT_TILE else f"_{tile}")
            yield (name, _attention_tma_kernel,
                   {"q_arg": t if config.kwargs["WARP_SPECIALIZE"] else q_desc, "k_desc": k_desc, "v_desc": v_desc,
                    "o_ptr": t, "cu_seqlens_ptr": torch.empty(16, dtype=torch.int32), "total_tokens": tokens,
                    "num_heads": heads, "scale_log2": 0.18, "stride_qs": hidden, "stride_os": hidden,
                    "HEAD_DIM": d}, [config])
