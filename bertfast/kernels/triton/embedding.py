"""Embedding gather + LayerNorm in one kernel: ``LayerNorm(word[id] + token_type[tt] + position[pos])``.

One program per token: up to three row gathers summed in fp32 (in the reference's order), then the
LayerNorm row helper shared with `layernorm`. Nothing is written between the gather and the norm. The
token-type and position tables are optional (rotary models have no position table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ROW_CONFIGS, _layernorm_row, check_device, check_float, check_shape, next_pow2

ID_DTYPES = (torch.int64, torch.int32)

@triton.autotune(configs=ROW_CONFIGS, key=["BLOCK_N"])
@triton.jit
def _embedding_kernel(
    ids_ptr, pos_ids_ptr, type_ids_ptr, word_ptr, pos_ptr, type_ptr, w_ptr, b_ptr, out_ptr,
    N, eps,
    stride_word, stride_pos, stride_type, stride_om,
    HAS_TOKEN_TYPE: tl.constexpr, HAS_POSITION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    tok = tl.load(ids_ptr + row).to(tl.int64)
    x = tl.load(word_ptr + tok * stride_word + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    if HAS_TOKEN_TYPE:
        tt = tl.load(type_ids_ptr + row).to(tl.int64)
        x += tl.load(type_ptr + tt * stride_type + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_POSITION:
        pos = tl.load(pos_ids_ptr + row).to(tl.int64)
        x += tl.load(pos_ptr + pos * stride_pos + offs, mask=mask, other=0.0).to(tl.float32)
    y = _layernorm_row(x, w_ptr, b_ptr, offs, mask, N, eps)
    tl.store(out_ptr + row * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

def _check_ids(op, name, ids, T, table_rows, check_values):
    if not torch.is_tensor(ids) or ids.dtype not in ID_DTYPES or ids.dim() != 1:
        desc = f"{ids.dtype} {tuple(ids.shape)}" if torch.is_tensor(ids) else type(ids).__name__
        raise ValueError(f"{op}: {name} must be a 1-D int64/int32 tensor, got {desc}")
    if ids.numel() != T:
        raise ValueError(f"{op}: {name} has {ids.numel()} entries, input_ids has {T}")
    if check_values and T > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table_rows:
            raise ValueError(f"{op}: {name} holds values in [{lo}, {hi}], the table has {table_rows} rows")

def embeddings(input_ids: torch.Tensor, position_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
          emb, eps: float, check_ids: bool = True) -> torch.Tensor:
    """LayerNorm(word[input_ids] + token_type[token_type_ids] + position[position_ids]).

    input_ids, position_ids, token_type_ids: (T,) int64 or int32 (token_type_ids None when the
    model has no token-type table; position_ids unused, and may be None, when it has no position
    table); emb: `bertfast.backends.weights.EmbeddingWeights` (word (V, H), position (P, H) or None,
    token_type (TT, H) or None, ln_weight/ln_bias (H,)), rows contiguous.
    check_ids=False skips the range checks of the ids (a device-to-host copy) for callers that
    validated them already. Returns (T, H) in the tables' dtype.
    """
    op = "embeddings"
    word = emb.word
    check_float(op, "word embeddings", word, 2)
    V, H = word.shape
    has_positions = emb.position is not None
    if has_positions:
        check_float(op, "position embeddings", emb.position, 2, word.dtype)
        check_shape(op, "position embeddings", emb.position, (emb.position.shape[0], H))
        if position_ids is None:
            raise ValueError(f"{op}: the model has a position table, position_ids is required")
    check_float(op, "LayerNorm weight", emb.ln_weight, 1, word.dtype)
    check_float(op, "LayerNorm bias", emb.ln_bias, 1, word.dtype)
    check_shape(op, "LayerNorm weight", emb.ln_weight, (H,))
    check_shape(op, "LayerNorm bias", emb.ln_bias, (H,))
    has_types = emb.token_type is not None
    if has_types:
        check_float(op, "token-type embeddings", emb.token_type, 2, word.dtype)
        check_shape(op, "token-type embeddings", emb.token_type, (emb.token_type.shape[0], H))
        if token_type_ids is None:
            raise ValueError(f"{op}: the model has a token-type table, token_type_ids is required")
    for name, table in (("word", word), ("position", emb.position), ("token-type", emb.token_type)):
        if table is not None and table.stride(1) != 1:
            raise ValueError(f"{op}: {name} embedding rows must be contiguous (stride(1) == 1)")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive float, got {eps!r}")
    if not torch.is_tensor(input_ids):
        raise ValueError(f"{op}: input_ids must be a tensor, got {type(input_ids).__name__}")
    T = input_ids.numel()
    _check_ids(op, "input_ids", input_ids, T, V, check_ids)
    tensors = [input_ids, word, emb.ln_weight, emb.ln_bias]
    if has_positions:
        _check_ids(op, "position_ids", position_ids, T, emb.position.shape[0], check_ids)
        tensors += [position_ids, emb.position]
    if has_types:
        _check_ids(op, "token_type_ids", token_type_ids, T, emb.token_type.shape[0], check_ids)
        tensors += [token_type_ids, emb.token_type]
    check_device(op, *tensors)
    out = torch.empty(T, H, dtype=word.dtype, device=word.device)
    if T > 0:
        # An absent table is stood in for by the word table and input_ids, never read.
        types = emb.token_type if has_types else word
        type_ids = token_type_ids if has_types else input_ids
        positions = emb.position if has_positions else word
        pos_ids = position_ids if has_positions else input_ids
        _embedding_kernel[(T,)](
            input_ids, pos_ids, type_ids, word, positions, types, emb.ln_weight, emb.ln_bias, out,
            H, float(eps), word.stride(0), positions.stride(0), types.stride(0), out.stride(0),
            HAS_TOKEN_TYPE=has_types, HAS_POSITION=has_positions, BLOCK_N=next_pow2(H),
        )
    return out

def aot_variants(dtype: torch.dtype = torch.float16, hidden: int = 768):
    """A representative BERT-base embeddings + LayerNorm launch for `bertfast kernels`:
    yields (name, jit_fn, {argument: representative value}, configs)."""
    t = torch.empty(16, dtype=dtype)  # stands for any 16-byte aligned buffer of this dtype
    ids = torch.empty(16, dtype=torch.int64)
    block_n = next_pow2(hidden)
    yield ("embedding", _embedding_kernel.fn,
           {"ids_ptr": ids, "pos_ids_ptr": ids, "type_ids_ptr": ids, "word_ptr": t, "pos_ptr": t, "type_ptr": t,
            "w_ptr": t, "b_ptr": t, "out_ptr": t, "N": hidden, "eps": 1e-12, "stride_word": hidden,
            "stride_pos": hidden, "stride_type": hidden, "stride_om": hidden, "HAS_TOKEN_TYPE": True,
            "HAS_POSITION": True, "BLOCK_N": block_n},
           ROW_CONFIGS)
