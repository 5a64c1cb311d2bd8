"""Flash attention forward: softmax(q k^T * scale) v without materialising the [S, S] scores.

One kernel, two modes chosen by a constexpr: a padded batch ``(B, heads, S, d)`` with an optional
key-padding mask, or packed variable-length tokens ``(T, heads, d)`` delimited by ``cu_seqlens``.
Each program owns BLOCK_M query rows of one (sequence, head) and streams K/V tiles through an
online softmax (running max and sum, fp32, in log2 units so the inner loop uses exp2).

Semantics match `bertfast.reference`: a masked key gets the most negative score (so a key-padding
mask that hides every key gives the uniform average of V, as Hugging Face does, never NaN); keys
past a sequence's end do not exist at all. Head dims that are not a power of two (26, 48, 80) are
padded to the BLOCK_D tile by masking loads and stores, never by copying.

Sliding windows (ModernBERT's local layers, varlen only): with window w > 0 a query t sees the keys u of its
sequence with |t - u| <= w. The key loop of a query tile starts at the first key tile that reaches its
first row's window and stops after its last row's, so work and memory stay linear in the sequence length;
keys inside those tiles but outside a row's window get the masked score.

A relative position bias (MPNet, varlen only) is added to each score tile from a compact per-distance table,
table[h, (width - 1) / 2 + pos[u] - pos[t]] (`backends.AttentionBias`), gathered per tile: never a (T, T)
matrix. DeBERTa-v2's disentangled terms likewise (`backends.DisentangledBias`): per tile, each pair's column
c = index[(width - 1) / 2 + pos[t] - pos[u]] and c2p[t, h, c] + p2c[u, h, c] gathered from the per-token tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, configs_for_mode, dot_precision, next_pow2

# A masked key's score (log2 units): finite so that a fully masked row is a uniform average
# (exp2(MASKED - MASKED) = 1), far enough below any real score that exp2 gives exactly 0 next to one.
MASKED = tl.constexpr(-1.0e30)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of this dtype's family that fit the problem (the autotuner's filter). Only the query tile
    (BLOCK_M) is ever chosen: the key step (BLOCK_N) is one per family, never pruned (see MMA_CONFIGS)."""
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    bucket = named_args["seqlen_bucket"]
    family = FMA_CONFIGS if named_args["q_ptr"].dtype == torch.float32 else MMA_CONFIGS
    kept = []
    for c in configs:
        if not any(c is f for f in family):
            continue
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        # Query tiles taller than the longest sequence only compute masked rows.
        if bm > max(64, bucket):
            continue
        # Registers: the fp32 accumulator [BLOCK_M, BLOCK_D] and the scores [BLOCK_M, BLOCK_N];
        # past this budget the d = 128 builds spill (`bertfast kernels`).
        if bm * (block_d + bn) > 128 * (128 + 32):
            continue
        kept.append(c)
    return kept or [c for c in configs if any(c is f for f in family)][-1:] or [configs[-1]]


# fp16/bf16 (tensor cores). BERT attention is short (S <= 512) with d = 64 mostly: 128-row query
# tiles keep the tensor cores busy on A100/H100; 64-row tiles serve short sequences and d = 128.
# Batch invariance: a row's output depends on how its keys are cut into BLOCK_N steps (the online softmax
# rescales at each step, and P is rounded to the input dtype against the running max), so every config of a
# family steps by the same BLOCK_N; the autotuner (keyed by the longest sequence of the batch) picks only the
# query tile, which never changes a row's arithmetic. (On an H200, with 32- and 64-key configs in one list, a
# ModernBERT row alone and inside a batch differed by one fp16 ulp.)
MMA_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    # ptxas caps 8-warp programs at 128 registers on its own and then spills the padded variant
    # on sm_80; the tile needs ~150.
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3, maxnreg=168),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
]
# fp32 with input_precision="ieee" runs on the FMA units: 16-key steps or it spills (d 64..128). One config:
# the row sums of a blocked layout are reduced in an order that depends on the tile's shape.
FMA_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 16}, num_warps=4, num_stages=2),
]
_CONFIGS = MMA_CONFIGS + FMA_CONFIGS
_INTERPRETER_CONFIG = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=1)


@triton.jit
def _attention_block(
    b, h, pid_m, q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, cu_seqlens_ptr, bias_ptr, positions_ptr, c2p_ptr, p2c_ptr,
    seqlen, head_dim, num_heads, scale_log2, window, bias_width, stride_bias_h, rel_cols,
    stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_os, stride_od, stride_mb, stride_ms,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Query rows [pid_m * BLOCK_M, +BLOCK_M) of sequence b, head h (nothing past the sequence's end): the attention
    kernel's program, also one work item of the persistent layer (`layer.py`), so both compute a row alike."""
    if IS_VARLEN:
        seq_start = tl.load(cu_seqlens_ptr + b)
        seq_len = tl.load(cu_seqlens_ptr + b + 1) - seq_start
        # int64: the packed row offset times its stride passes 2^31 for long packed batches.
        row0 = seq_start.to(tl.int64)
    else:
        seq_len = seqlen
        row0 = 0
    if pid_m * BLOCK_M < seq_len:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < seq_len
        mask_d = offs_d < head_dim
        q_base = q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + row0 * stride_qs
        k_base = k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + row0 * stride_ks
        v_base = v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + row0 * stride_vs
        o_base = o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + row0 * stride_os

        q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if HAS_BIAS:
            # Table column of distance 0, shifted by each query's position: column = base_m[t] + pos[u].
            pos_m = tl.load(positions_ptr + row0 + offs_m, mask=mask_m, other=0)  # [BLOCK_M] int32
            base_m = (bias_width - 1) // 2 - pos_m
            bias_row = bias_ptr + h * stride_bias_h
        if HAS_C2P or HAS_P2C:
            # DeBERTa-v2: index entry of distance 0, shifted by each query's position: entry = base_m[t] - pos[u];
            # the tables' rows are (token, head) pairs of rel_cols columns.
            pos_m = tl.load(positions_ptr + row0 + offs_m, mask=mask_m, other=0)  # [BLOCK_M] int32
            base_m = (bias_width - 1) // 2 + pos_m
            c2p_rows = c2p_ptr + ((row0 + offs_m) * num_heads + h) * rel_cols  # [BLOCK_M] pointers
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

        lo = 0
        hi = seq_len
        if HAS_WINDOW:
            # Key tiles that reach the window of at least one row of this query tile: [first row - w, last row + w].
            lo = (tl.maximum(pid_m * BLOCK_M - window, 0) // BLOCK_N) * BLOCK_N
            hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M + window)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            mask_n = cols < seq_len
            kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            if HAS_BIAS:
                pos_n = tl.load(positions_ptr + row0 + cols, mask=mask_n, other=0)  # [BLOCK_N] int32
                # Clamped like the reference's dense form; real tokens of one sequence always fall inside.
                column = tl.minimum(tl.maximum(base_m[:, None] + pos_n[None, :], 0), bias_width - 1)
                bias = tl.load(bias_row + column, mask=mask_m[:, None] & mask_n[None, :],
                               other=0.0)  # [BLOCK_M, BLOCK_N]
                s += bias * 1.4426950408889634  # to log2 units, as scale_log2 is
            if HAS_C2P or HAS_P2C:
                pos_n = tl.load(positions_ptr + row0 + cols, mask=mask_n, other=0)  # [BLOCK_N] int32
                mask_mn = mask_m[:, None] & mask_n[None, :]
                entry = tl.minimum(tl.maximum(base_m[:, None] - pos_n[None, :], 0), bias_width - 1)
                c = tl.load(bias_ptr + entry, mask=mask_mn, other=0)  # [BLOCK_M, BLOCK_N] int32 columns
                term = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if HAS_C2P:
                    term += tl.load(c2p_rows[:, None] + c, mask=mask_mn, other=0.0)
                if HAS_P2C:
                    p2c_rows = p2c_ptr + ((row0 + cols) * num_heads + h) * rel_cols  # [BLOCK_N] pointers
                    term += tl.load(p2c_rows[None, :] + c, mask=mask_mn, other=0.0)
                s += term * 1.4426950408889634
            if HAS_MASK:
                keep = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + cols * stride_ms, mask=mask_n, other=0)
                s = tl.where((keep != 0)[None, :], s, MASKED)
            if HAS_WINDOW:
                # MASKED, not -inf: a row may see no key of its window in this tile (m_new stays finite); what such
                # keys add is scaled by alpha = exp2(MASKED - real max) = 0 once the row meets its own window,
                # which always holds the row's own token.
                in_window = ((cols[None, :] >= (offs_m - window)[:, None])
                             & (cols[None, :] <= (offs_m + window)[:, None]))
                s = tl.where(in_window, s, MASKED)
            s = tl.where(mask_n[None, :], s, float("-inf"))
            # Every tile holds at least one in-range key, so m_new is finite and alpha well defined.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new

        acc = acc / l_i[:, None]
        tl.store(o_base + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od,
                 acc.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.autotune(configs=configs_for_mode(_CONFIGS, _INTERPRETER_CONFIG),
                 key=["seqlen_bucket", "BLOCK_D", "IS_VARLEN", "HAS_WINDOW", "HAS_BIAS", "HAS_C2P", "HAS_P2C"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.jit(do_not_specialize=["seqlen", "seqlen_bucket", "scale_log2", "window", "bias_width", "rel_cols"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, cu_seqlens_ptr, bias_ptr, positions_ptr, c2p_ptr, p2c_ptr,
    seqlen, seqlen_bucket, head_dim, num_heads, scale_log2, window, bias_width, stride_bias_h, rel_cols,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_mb, stride_ms,
    IS_VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_C2P: tl.constexpr, HAS_P2C: tl.constexpr, BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # seqlen_bucket only keys the autotuner (next power of two of the longest sequence).
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    _attention_block(
        b, h, pid_m, q_ptr, k_ptr, v_ptr, o_ptr, mask_ptr, cu_seqlens_ptr, bias_ptr, positions_ptr, c2p_ptr, p2c_ptr,
        seqlen, head_dim, num_heads, scale_log2, window, bias_width, stride_bias_h, rel_cols,
        stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd, stride_ob, stride_oh, stride_os, stride_od, stride_mb, stride_ms,
        IS_VARLEN, HAS_MASK, HAS_WINDOW, HAS_BIAS, HAS_C2P, HAS_P2C, BLOCK_D, INPUT_PRECISION, BLOCK_M, BLOCK_N)


def _check_qkv(op: str, q, k, v, ndim: int):
    check_float(op, "q", q, ndim)
    check_float(op, "k", k, ndim, q.dtype)
    check_float(op, "v", v, ndim, q.dtype)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{op}: q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")


def check_varlen(op: str, cu_seqlens, max_seqlen) -> None:
    """cu_seqlens a 1-D int32 (B+1,) tensor, B >= 0, and max_seqlen a non-negative int (their values are checked
    apart, with a device-to-host copy, where the caller asks)."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        desc = (f"{cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}" if torch.is_tensor(cu_seqlens)
                else type(cu_seqlens).__name__)
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32 tensor (B+1,), got {desc}")
    if cu_seqlens.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens must hold at least one element (B+1 with B >= 0)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{op}: max_seqlen must be a non-negative int, got {max_seqlen!r}")


def check_varlen_values(op: str, cu_seqlens: torch.Tensor, max_seqlen: int, T: int) -> None:
    """cu_seqlens starts at 0, never decreases and ends at T, and no sequence is longer than max_seqlen (one read
    back from the device)."""
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != T or any(n < 0 for n in lengths):
        raise ValueError(f"{op}: cu_seqlens must start at 0, be non-decreasing and end at T = {T}; "
                         f"got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(f"{op}: max_seqlen = {max_seqlen} but a sequence has {max(lengths)} tokens")


def _check_bias(op: str, bias, T: int, heads: int):
    """A relative position bias (table (heads, width) float32, rows contiguous; positions (T,) int32); returns it."""
    if not isinstance(bias, tuple) or len(bias) != 2:
        raise ValueError(f"{op}: bias must be a (table, positions) pair (backends.AttentionBias), got "
                         f"{type(bias).__name__}")
    table, positions = bias
    if (not torch.is_tensor(table) or table.dtype != torch.float32 or table.dim() != 2 or table.shape[0] != heads
            or table.shape[1] % 2 == 0 or (table.stride(1) != 1 and table.shape[1] > 1)):
        desc = f"{table.dtype} {tuple(table.shape)}" if torch.is_tensor(table) else type(table).__name__
        raise ValueError(f"{op}: the bias table must be float32 (heads = {heads}, odd width) with contiguous rows, "
                         f"got {desc}")
    if (not torch.is_tensor(positions) or positions.dtype != torch.int32 or tuple(positions.shape) != (T,)
            or (T > 1 and positions.stride(0) != 1)):
        desc = f"{positions.dtype} {tuple(positions.shape)}" if torch.is_tensor(positions) else type(positions).__name__
        raise ValueError(f"{op}: the bias positions must be a contiguous int32 (T,) = ({T},) tensor, got {desc}")
    return table, positions


def _check_terms(op: str, terms, T: int, heads: int):
    """DeBERTa-v2's disentangled terms (c2p, p2c, index, positions) (`backends.DisentangledBias`): c2p / p2c float32
    (T, heads, cols) contiguous, at least one of them; index (width,) int32 contiguous, width odd, values in
    [0, cols) (not read back: the engine builds it); positions as a bias's. Returns them."""
    c2p, p2c, index, positions = terms
    tables = [t for t in (c2p, p2c) if t is not None]
    if not tables:
        raise ValueError(f"{op}: the disentangled terms need c2p or p2c")
    for name, t in (("c2p", c2p), ("p2c", p2c)):
        if t is not None and (not torch.is_tensor(t) or t.dtype != torch.float32 or t.dim() != 3
                              or tuple(t.shape[:2]) != (T, heads) or t.shape[2] != tables[0].shape[2]
                              or not t.is_contiguous()):
            desc = f"{t.dtype} {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a contiguous float32 (T, heads, cols) = ({T}, {heads}, cols) "
                             f"tensor (one cols for both), got {desc}")
    if (not torch.is_tensor(index) or index.dtype != torch.int32 or index.dim() != 1 or index.shape[0] % 2 == 0
            or not index.is_contiguous()):
        raise ValueError(f"{op}: the disentangled index must be a contiguous int32 (width,) tensor, width odd")
    _check_bias(op, (index[None, :].float(), positions), T, 1)
    return c2p, p2c, index, positions


def _launch(q, k, v, out, mask, cu_seqlens, batch, heads, seqlen, max_seqlen, scale, strides_bhsd, window=0,
            bias=None, terms=None):
    d = q.shape[-1]
    block_d = max(16, next_pow2(d))  # tl.dot needs K >= 16
    bucket = max(16, next_pow2(max_seqlen))
    grid = lambda meta: (batch * heads, triton.cdiv(max_seqlen, meta["BLOCK_M"]))  # noqa: E731
    sq, sk, sv, so = strides_bhsd
    sm = (mask.stride(0), mask.stride(1)) if mask is not None else (0, 0)
    table, positions = bias if bias is not None else (q, q)  # stand-ins, never read without HAS_BIAS
    c2p = p2c = None
    if terms is not None:  # DeBERTa-v2: the index in the table's slot (its width odd, like the table's)
        c2p, p2c, index, positions = terms
        table = index[None, :]
    width = table.shape[1] if bias is not None or terms is not None else 1
    cols = (c2p if c2p is not None else p2c).shape[2] if terms is not None else 0
    _attention_kernel[grid](
        q, k, v, out, mask if mask is not None else q, cu_seqlens if cu_seqlens is not None else q, table, positions,
        c2p if c2p is not None else q, p2c if p2c is not None else q,
        seqlen, bucket, d, heads, float(scale) * 1.4426950408889634, window,
        width, table.stride(0) if bias is not None else 0, cols,
        *sq, *sk, *sv, *so, *sm,
        IS_VARLEN=cu_seqlens is not None, HAS_MASK=mask is not None, HAS_WINDOW=window > 0,
        HAS_BIAS=bias is not None, HAS_C2P=c2p is not None, HAS_P2C=p2c is not None, BLOCK_D=block_d,
        INPUT_PRECISION=dot_precision(q.dtype),
    )


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float, validate: bool = True, window: int = 0,
                     bias=None) -> torch.Tensor:
    """Attention of packed variable-length sequences; each sequence attends to itself only.

    q, k, v: (T, heads, d), one float dtype, any strides; cu_seqlens: (B+1,) int32 on the same
    device, cu_seqlens[0] = 0, non-decreasing, cu_seqlens[-1] = T (empty sequences allowed);
    max_seqlen: int >= the longest sequence; window: int >= 0, > 0 for a sliding window (token t sees
    the tokens u of its sequence with |t - u| <= window; the key tiles outside it are never visited);
    bias: None or a relative position bias (table, positions) (`backends.AttentionBias`): table (heads, width)
    float32 with width odd and rows contiguous, positions (T,) int32 contiguous; score(t, u) gains
    table[h, (width - 1) / 2 + positions[u] - positions[t]] (clamped to the table), added in fp32; or DeBERTa-v2's
    (c2p, p2c, index, positions) (`backends.DisentangledBias`): score(t, u) gains c2p[t, h, c] + p2c[u, h, c] with
    c = index[(width - 1) / 2 + positions[t] - positions[u]].
    Returns (T, heads * d) in q's dtype.
    validate=False skips the checks of cu_seqlens' values (they need a device-to-host copy); use it
    only with cu_seqlens built by `bertfast.padding.unpad`.
    """
    op = "attention"
    _check_qkv(op, q, k, v, 3)
    check_varlen(op, cu_seqlens, max_seqlen)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{op}: window must be a non-negative int (0 = no window), got {window!r}")
    T, heads, d = q.shape
    tensors = [q, k, v, cu_seqlens]
    terms = None
    if bias is not None and len(bias) == 4:  # DeBERTa-v2's DisentangledBias
        terms, bias = _check_terms(op, bias, T, heads), None
        tensors += [t for t in terms if t is not None]
    elif bias is not None:
        tensors += list(_check_bias(op, bias, T, heads))
    check_device(op, *tensors)
    if validate:
        check_varlen_values(op, cu_seqlens, max_seqlen, T)
    out = torch.empty(T, heads, d, dtype=q.dtype, device=q.device)
    batch = cu_seqlens.numel() - 1
    if T > 0 and batch > 0 and max_seqlen > 0:
        # Varlen: (b, h, s, d) strides with no batch stride; the sequence start comes from cu_seqlens.
        strides = [(0, t.stride(1), t.stride(0), t.stride(2)) for t in (q, k, v, out)]
        # A window as wide as the longest sequence hides nothing: the plain kernel then.
        _launch(q, k, v, out, None, cu_seqlens, batch, heads, 0, max_seqlen, scale, strides,
                window if window < max_seqlen else 0, bias, terms)
    return out.view(T, heads * d)


attention = attention_varlen


def attention_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Attention of a padded batch with a key-padding mask, Hugging Face semantics.

    q, k, v: (B, heads, S, d), one float dtype, any strides; key_mask: (B, S) bool or 0/1 numbers,
    True/1 = real key, or None. A row whose keys are all masked returns the mean of V over S.
    Returns (B, heads, S, d) contiguous in q's dtype.
    """
    op = "attention_padded"
    _check_qkv(op, q, k, v, 4)
    B, heads, S, d = q.shape
    tensors = [q, k, v]
    mask = None
    if key_mask is not None:
        if not torch.is_tensor(key_mask) or tuple(key_mask.shape) != (B, S):
            shape = tuple(key_mask.shape) if torch.is_tensor(key_mask) else type(key_mask).__name__
            raise ValueError(f"{op}: key_mask must be a (B, S) = {(B, S)} tensor, got {shape}")
        if key_mask.dtype.is_complex:
            raise ValueError(f"{op}: key_mask must be bool or 0/1 numbers, got {key_mask.dtype}")
        tensors.append(key_mask)
        # The kernel reads one byte per key: bool is viewed as uint8 without a copy.
        mask = key_mask.view(torch.uint8) if key_mask.dtype == torch.bool else (key_mask != 0).view(torch.uint8)
    check_device(op, *tensors)
    out = torch.empty(B, heads, S, d, dtype=q.dtype, device=q.device)
    if B > 0 and S > 0 and heads > 0:
        strides = [tuple(t.stride()) for t in (q, k, v, out)]
        _launch(q, k, v, out, mask, None, B, heads, S, S, scale, strides)
    return out


def aot_variants(dtype: torch.dtype = torch.float16, heads: int = 12, head_dim: int = 64, seqlen: int = 128):
    """Representative BERT-base attention launches (d = 64, contiguous (T, heads, d) from the QKV
    kernel, or (B, heads, S, d)) in both modes, varlen with ModernBERT's sliding window (+-64) and varlen with
    MPNet's relative position bias, for `bertfast kernels`: yields (name, jit_fn, {argument: representative
    value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    block_d = max(16, next_pow2(head_dim))
    bucket = max(16, next_pow2(seqlen))
    configs = _prune_configs(_CONFIGS, {"seqlen_bucket": bucket, "q_ptr": t}, BLOCK_D=block_d)
    hidden = heads * head_dim
    common = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "o_ptr": t, "mask_ptr": torch.empty(16, dtype=torch.uint8),
              "cu_seqlens_ptr": torch.empty(16, dtype=torch.int32), "seqlen_bucket": bucket,
              "bias_ptr": torch.empty(16, dtype=torch.float32), "positions_ptr": torch.empty(16, dtype=torch.int32),
              "c2p_ptr": torch.empty(16, dtype=torch.float32), "p2c_ptr": torch.empty(16, dtype=torch.float32),
              "head_dim": head_dim, "num_heads": heads, "scale_log2": 0.18, "window": 0, "bias_width": 1,
              "stride_bias_h": 0, "rel_cols": 0, "HAS_WINDOW": False, "HAS_BIAS": False, "HAS_C2P": False,
              "HAS_P2C": False, "BLOCK_D": block_d,
              "INPUT_PRECISION": dot_precision(dtype)}
    varlen_strides = {f"stride_{x}{a}": v for x in "qkvo" for a, v in zip("bhsd", (0, head_dim, hidden, 1))}
    padded_strides = {f"stride_{x}{a}": v for x in "qkvo"
                      for a, v in zip("bhsd", (hidden * seqlen, seqlen * head_dim, head_dim, 1))}
    yield ("attention_varlen", _attention_kernel.fn,
           {**common, **varlen_strides, "seqlen": 0, "stride_mb": 0, "stride_ms": 0, "IS_VARLEN": True,
            "HAS_MASK": False}, configs)
    yield ("attention_padded", _attention_kernel.fn,
           {**common, **padded_strides, "seqlen": seqlen, "stride_mb": seqlen, "stride_ms": 1,
            "IS_VARLEN": False, "HAS_MASK": True}, configs)
    yield ("attention_window", _attention_kernel.fn,
           {**common, **varlen_strides, "seqlen": 0, "stride_mb": 0, "stride_ms": 0, "IS_VARLEN": True,
            "HAS_MASK": False, "window": 64, "HAS_WINDOW": True}, configs)
    yield ("attention_bias", _attention_kernel.fn,
           {**common, **varlen_strides, "seqlen": 0, "stride_mb": 0, "stride_ms": 0, "IS_VARLEN": True,
            "HAS_MASK": False, "bias_width": 2 * seqlen - 1, "stride_bias_h": 2 * seqlen - 1, "HAS_BIAS": True},
           configs)
