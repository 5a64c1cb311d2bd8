"""A whole post-LayerNorm BERT layer in one launch: a persistent kernel that works through the layer's tiles in order.

The layer is seven phases: the fused QKV GEMM, attention per (sequence, head, query block), attention-out GEMM +
residual, LayerNorm, FFN-in GEMM + activation, FFN-out GEMM + residual, LayerNorm. Their work items are numbered
phase after phase; each program claims the next number from one atomic counter, waits until the phase before the
item's own is complete (a counter per phase, incremented with release semantics as each item finishes, read with
acquire semantics), runs it and claims again. A program only waits on items numbered below its own, all claimed by
programs already running, so the kernel cannot deadlock whatever the grid and whatever runs concurrently; the
interpreter, which runs programs one after another, has program 0 take every item in order.

Each item runs the same tile code as the op-by-op kernels (`_gemm_tile` with linear's epilogue, `_attention_block`,
`_layernorm_row`) with tile sizes of the same family (tensor-core or FMA), so a row gets the bits of the op-by-op
path: which path a call takes (its token count) never changes a row's result. Small calls gain the most: one
launch instead of seven per layer, and every tile of a phase spread over all the GPU's programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, _gemm_tile, _layernorm_row, _tile_of, check_device, dot_precision, next_pow2
from .attention import _attention_block
from .linear import _gemm_epilogue

# The token counts a call runs through this kernel (more tokens: the op-by-op kernels, tuned for large GEMMs).
MAX_TOKENS = 512
MAX_HIDDEN = 1024  # a LayerNorm item holds a whole row in registers
LN_ROWS = 4  # rows per LayerNorm item
PHASES = 7


def _tiles(dtype: torch.dtype, tokens: int, arch: int) -> tuple[dict, int]:
    """(tile sizes, pipeline stages) of the same family as the op-by-op kernels' configs (linear/qkv
    `_common.CONFIGS`, attention's), so that a row's arithmetic matches theirs: under the interpreter their single
    config. WIDE_N tiles the QKV and FFN-in outputs, NARROW_N the two of width H: on Hopper (arch 90) at a few tokens,
    narrower column tiles give more programs to stream the weights with, and a tensor-core tile's column count changes
    no element's sum (sm_80 spills with two tile widths in one kernel). fp32 takes 32-row GEMM tiles: with 64 rows
    ptxas spills on sm_90 (`bertfast kernels --dtype fp32`)."""
    if INTERPRET:
        return dict(BLOCK_M=64, WIDE_N=64, NARROW_N=64, BLOCK_K=64, GROUP_M=4, ATT_M=64, ATT_N=32), 1
    if dtype == torch.float32:
        return dict(BLOCK_M=32, WIDE_N=64, NARROW_N=64, BLOCK_K=32, GROUP_M=8, ATT_M=64, ATT_N=16), 2
    wide, narrow = 64, 64
    if arch >= 90:
        wide, narrow = (32, 16) if tokens <= 64 else (64, 32) if tokens <= 128 else (64, 64)
    return dict(BLOCK_M=64, WIDE_N=wide, NARROW_N=narrow, BLOCK_K=64, GROUP_M=8, ATT_M=64, ATT_N=64), 3


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until the counter reaches `target`; acquire, so the phase's stores are visible to every thread after."""
    done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while done < target:
        done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _gemm_item(item, x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, M, N, K, hidden,
               ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QKV_OUT: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    """One output tile of act(x @ w.T + b) (+ residual), all row-major; QKV_OUT: stored as the q, k, v planes
    [3, M, hidden] that `qkv.qkv` writes. linear's and qkv's own epilogue."""
    pid_m, pid_n = _tile_of(item, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, offs_m, offs_n = _gemm_tile(x_ptr, w_ptr, M, N, K, K, 1, K, 1, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                                     INPUT_PRECISION)
    _gemm_epilogue(acc, offs_m, offs_n, M, N, b_ptr, res_ptr, N, 1, out_ptr, N, hidden, 1.0, b_ptr, 0, ACTIVATION,
                   True, HAS_RESIDUAL, QKV_OUT, False, False)


@triton.jit
def _layernorm_item(item, x_ptr, w_ptr, b_ptr, out_ptr, M, N, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """LayerNorm of rows [item * ROWS, +ROWS), each as `layernorm`'s program computes it."""
    offs = tl.arange(0, BLOCK_H)
    mask = offs < N
    for r in range(ROWS):
        row = item * ROWS + r
        if row < M:
            x = tl.load(x_ptr + row.to(tl.int64) * N + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H]
            y = _layernorm_row(x, w_ptr, b_ptr, offs, mask, N, eps)
            tl.store(out_ptr + row.to(tl.int64) * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "B", "max_blocks", "scale_log2", "eps"])
def _bert_layer_kernel(
    x_ptr, qkv_w, qkv_b, out_w, out_b, ln1_w, ln1_b, in_w, in_b, ffn_w, ffn_b, ln2_w, ln2_b,
    qkv_ptr, ctx_ptr, sum1_ptr, x1_ptr, h_ptr, sum2_ptr, y_ptr, cu_seqlens_ptr, work_ptr,
    T, B, max_blocks, H, INTER, heads, head_dim, scale_log2, eps,
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    LN_ITEM_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, WIDE_N: tl.constexpr, NARROW_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, ATT_M: tl.constexpr, ATT_N: tl.constexpr,
):
    # work_ptr: int32 [1 + PHASES], zeroed before the launch: the next item, then each phase's finished items.
    m_tiles = tl.cdiv(T, BLOCK_M)
    n_qkv = m_tiles * tl.cdiv(3 * H, WIDE_N)
    n_att = B * heads * max_blocks
    n_out = m_tiles * tl.cdiv(H, NARROW_N)
    n_ln = tl.cdiv(T, LN_ITEM_ROWS)
    n_in = m_tiles * tl.cdiv(INTER, WIDE_N)
    e_qkv = n_qkv
    e_att = e_qkv + n_att
    e_out = e_att + n_out
    e_ln1 = e_out + n_ln
    e_in = e_ln1 + n_in
    e_ffn = e_in + n_out
    total = e_ffn + n_ln
    item = tl.atomic_add(work_ptr, 1)
    while item < total:
        phase = ((item >= e_qkv).to(tl.int32) + (item >= e_att).to(tl.int32) + (item >= e_out).to(tl.int32)
                 + (item >= e_ln1).to(tl.int32) + (item >= e_in).to(tl.int32) + (item >= e_ffn).to(tl.int32))
        if phase == 0:
            _gemm_item(item, x_ptr, qkv_w, qkv_b, x_ptr, qkv_ptr, T, 3 * H, H, H, "none", False, True,
                       INPUT_PRECISION, BLOCK_M, WIDE_N, BLOCK_K, GROUP_M)
        elif phase == 1:
            _wait_for(work_ptr + 1, n_qkv)
            i = item - e_qkv
            b = i // (heads * max_blocks)
            h = (i // max_blocks) % heads
            plane = T * H  # q, k, v planes of [T, heads, d]
            _attention_block(
                b, h, i % max_blocks, qkv_ptr, qkv_ptr + plane, qkv_ptr + 2 * plane, ctx_ptr, cu_seqlens_ptr,
                cu_seqlens_ptr, cu_seqlens_ptr, cu_seqlens_ptr, cu_seqlens_ptr, cu_seqlens_ptr,
                0, head_dim, heads, scale_log2, 0, 1, 0, 0,
                0, head_dim, H, 1, 0, head_dim, H, 1, 0, head_dim, H, 1, 0, head_dim, H, 1, 0, 0,
                True, False, False, False, False, False, BLOCK_D, INPUT_PRECISION, ATT_M, ATT_N)
        elif phase == 2:
            _wait_for(work_ptr + 2, n_att)
            _gemm_item(item - e_att, ctx_ptr, out_w, out_b, x_ptr, sum1_ptr, T, H, H, H, "none", True, False,
                       INPUT_PRECISION, BLOCK_M, NARROW_N, BLOCK_K, GROUP_M)
        elif phase == 3:
            _wait_for(work_ptr + 3, n_out)
            _layernorm_item(item - e_out, sum1_ptr, ln1_w, ln1_b, x1_ptr, T, H, eps, LN_ITEM_ROWS, BLOCK_H)
        elif phase == 4:
            _wait_for(work_ptr + 4, n_ln)
            _gemm_item(item - e_ln1, x1_ptr, in_w, in_b, x1_ptr, h_ptr, T, INTER, H, H, ACTIVATION, False, False,
                       INPUT_PRECISION, BLOCK_M, WIDE_N, BLOCK_K, GROUP_M)
        elif phase == 5:
            _wait_for(work_ptr + 5, n_in)
            _gemm_item(item - e_in, h_ptr, ffn_w, ffn_b, x1_ptr, sum2_ptr, T, H, INTER, H, "none", True, False,
                       INPUT_PRECISION, BLOCK_M, NARROW_N, BLOCK_K, GROUP_M)
        else:
            _wait_for(work_ptr + 6, n_out)
            _layernorm_item(item - e_ffn, sum2_ptr, ln2_w, ln2_b, y_ptr, T, H, eps, LN_ITEM_ROWS, BLOCK_H)
        # Every thread's stores of the item are done before the release publishes them.
        tl.debug_barrier()
        tl.atomic_add(work_ptr + 1 + phase, 1, sem="release")
        item = tl.atomic_add(work_ptr, 1)


def _programs(device: torch.device) -> int:
    """The persistent grid: one program per SM (the interpreter: two, the second finds the work taken)."""
    if device.type != "cuda":
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def fits(T: int, hidden: int, heads: int, dtype: torch.dtype) -> bool:
    """Whether `bert_layer` runs a call of T tokens of this shape (else the op-by-op kernels)."""
    return 0 < T <= MAX_TOKENS and hidden <= MAX_HIDDEN and hidden % heads == 0 and dtype in (
        torch.float32, torch.float16, torch.bfloat16)


def bert_layer(x, layer, cu_seqlens, max_seqlen: int, heads: int, scale: float, eps: float, act: str,
               work: torch.Tensor) -> torch.Tensor:
    """One post-LayerNorm BERT layer on packed tokens x (T, H), the same bits as qkv -> attention_varlen ->
    linear(+x) -> layernorm -> linear(act) -> linear(+) -> layernorm. layer: `backends.weights.LayerWeights` with
    every bias; cu_seqlens (B+1,) int32 (from `padding.unpad`: not read back); work: int32 (1 + PHASES,) zeros,
    this launch's counters. Returns (T, H) in x's dtype."""
    op = "bert_layer"
    T, H = x.shape
    inter = layer.ffn_in_weight.shape[0]
    if not fits(T, H, heads, x.dtype) or not x.is_contiguous():
        raise ValueError(f"{op}: {T} tokens of hidden {H} ({x.dtype}, contiguous {x.is_contiguous()}) do not fit "
                         f"the persistent layer (1..{MAX_TOKENS} contiguous tokens, hidden <= {MAX_HIDDEN})")
    if work.dtype != torch.int32 or work.numel() != 1 + PHASES:
        raise ValueError(f"{op}: work must be {1 + PHASES} int32 counters, got {work.dtype} {tuple(work.shape)}")
    weights = (layer.qkv_weight, layer.qkv_bias, layer.attn_out_weight, layer.attn_out_bias, layer.attn_ln_weight,
               layer.attn_ln_bias, layer.ffn_in_weight, layer.ffn_in_bias, layer.ffn_out_weight, layer.ffn_out_bias,
               layer.ffn_ln_weight, layer.ffn_ln_bias)
    if any(w is None or not w.is_contiguous() for w in weights):
        raise ValueError(f"{op}: the layer needs every weight and bias, contiguous")
    check_device(op, x, cu_seqlens, work, *weights)
    d = H // heads
    arch = 0
    if x.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(x.device)
        arch = 10 * major + minor
    tiles, stages = _tiles(x.dtype, T, arch)
    empty = lambda *shape: torch.empty(*shape, dtype=x.dtype, device=x.device)  # noqa: E731
    qkv, ctx, sum1, x1, h, sum2, y = empty(3, T, H), empty(T, H), empty(T, H), empty(T, H), empty(T, inter), \
        empty(T, H), empty(T, H)
    _bert_layer_kernel[(_programs(x.device),)](
        x, *weights, qkv, ctx, sum1, x1, h, sum2, y, cu_seqlens, work,
        T, cu_seqlens.numel() - 1, triton.cdiv(max_seqlen, tiles["ATT_M"]), H, inter, heads, d,
        float(scale) * 1.4426950408889634, float(eps),
        ACTIVATION=act, INPUT_PRECISION=dot_precision(x.dtype), BLOCK_D=max(16, next_pow2(d)),
        BLOCK_H=next_pow2(H), LN_ITEM_ROWS=LN_ROWS, num_warps=4, num_stages=stages, **tiles)
    return y


def aot_variants(dtype: torch.dtype = torch.float16, hidden: int = 768):
    """The BERT-base layer (GELU, d = 64) for `bertfast kernels`: yields (name, jit_fn, {argument: value}, configs,
    min arch)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    ints = torch.empty(16, dtype=torch.int32)
    names = ("x_ptr qkv_w qkv_b out_w out_b ln1_w ln1_b in_w in_b ffn_w ffn_b ln2_w ln2_b qkv_ptr ctx_ptr sum1_ptr "
             "x1_ptr h_ptr sum2_ptr y_ptr").split()
    # (name, tokens, the arch its tiles are for): Hopper's narrower column tiles at 16 and 128 tokens, built for sm_90.
    for name, tokens, arch in (("bert_layer", 512, 0), ("bert_layer_s128", 128, 90), ("bert_layer_s16", 16, 90)):
        tiles, stages = _tiles(dtype, tokens, arch)
        values = {name: t for name in names}
        values.update(cu_seqlens_ptr=ints, work_ptr=ints, T=tokens, B=1, max_blocks=2, H=hidden, INTER=4 * hidden,
                      heads=hidden // 64, head_dim=64, scale_log2=0.18, eps=1e-12, ACTIVATION="gelu",
                      INPUT_PRECISION=dot_precision(dtype), BLOCK_D=64, BLOCK_H=next_pow2(hidden),
                      LN_ITEM_ROWS=LN_ROWS, **tiles)
        yield (name, _bert_layer_kernel, values, [triton.Config({}, num_warps=4, num_stages=stages)], arch)
