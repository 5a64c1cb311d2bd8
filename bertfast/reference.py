"""Eager reference: the exact math of Hugging Face's `BertModel`, in plain torch, in any dtype.

This module is the oracle (the torch backend wraps its ops). Its op functions (`embeddings`, `qkv`, `attention`,
`linear`, `linear_glu`, `linear_gelu`, `linear_residual`, `layernorm`, `pooler`, `disentangled`, `sparse_pool`) define
what every backend's op must compute (the engine composes them into a layer once, `engine.compose_layer`), and
`forward` runs the whole padded model the way `transformers` does (additive key-padding mask, position ids
``0..S-1`` or from the ids; MPNet's relative position bias; DeBERTa-v2's disentangled attention; RoPE). Tests check
`forward` against `transformers` itself; kernels and backends are checked against the op functions.

It imports none of the engine's math: position ids, MPNet's buckets, DeBERTa-v2's log buckets, RoPE tables and the
activations are written here from transformers' formulas (tests/test_reference_independent.py parses the imports and
checks each against transformers and the engine's own module). What remains from bertfast is data: the backend
contract's NamedTuples (`AttentionBias`, `DisentangledBias`, `Rotary`: the ops' argument types) and the weights
dataclasses, read by field (`ModelConfig` likewise, through `weights.config`, by its stored fields only). Nothing
here is tuned for speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .backends.contract import AttentionBias, DisentangledBias, Rotary
from .backends.weights import EmbeddingWeights, LayerWeights, ModelWeights
# The formulas of activations and positions; those the oracle's callers reach as `reference.<name>` are re-exported.
from .reference_formulas import (HF_ACTIVATIONS, _rotate_halves, activation, deberta_span,  # noqa: F401
                                 log_bucket, relative_bucket, rotary_tables, rotate_half)


# ----------------------------------------------------------------------------------------------
# Ops on the packed token layout: x is [T, H] (T tokens of any number of sequences).


def embeddings(input_ids, position_ids, token_type_ids, emb: EmbeddingWeights, eps: float,
               lora: dict | None = None) -> torch.Tensor:
    """LayerNorm(word[ids] + token_type[tt] + position[pos]) (the embedding projection is separate).

    input_ids, position_ids, token_type_ids: (T,) int64 (token_type_ids may be None when the model
    has no token-type table). lora: an adapter's tables (`Adapter.embeddings`: table -> (A, B)), each looked-up row
    plus its term A^T[id] B^T unmerged as PEFT runs it (fp32, fp64 for fp64 tables), or None. Returns (T, H) in the
    weights' dtype.
    """
    def look_up(name, ids):
        table = getattr(emb, name)
        if lora is None or name not in lora:
            return table[ids]
        A, B = lora[name]
        c = table.dtype if table.dtype == torch.float64 else torch.float32
        return table[ids] + (A.to(table.device, c).T[ids] @ B.to(table.device, c).T).to(table.dtype)

    x = look_up("word", input_ids)
    if emb.token_type is not None:
        x = x + look_up("token_type", token_type_ids)
    if emb.position is not None:  # rotary models (ModernBERT, NomicBERT, GTE) have no position table
        x = x + look_up("position", position_ids)
    return F.layer_norm(x, (x.shape[-1],), emb.ln_weight, emb.ln_bias, eps)


def rotate(x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """RoPE, half-split convention (`backends.Rotary`): x (T, heads, d), cos/sin (T, d/2) fp32 -> (T, heads, d)
    in x's dtype, computed in fp32."""
    return _rotate_halves(x, rotary.cos[:, None, :], rotary.sin[:, None, :])


def qkv(x, weight, bias, num_heads: int, rotary: Rotary | None = None):
    """Fused projection. x: (T, H); weight: (3H, H); bias: (3H,) or None; rotary: RoPE for q and k or None.
    Returns q, k, v: (T, heads, d)."""
    T = x.shape[0]
    out = F.linear(x, weight, bias).view(T, 3, num_heads, -1)
    q, k, v = out[:, 0], out[:, 1], out[:, 2]
    if rotary is not None:
        q, k = rotate(q, rotary), rotate(k, rotary)
    return q, k, v


def attention_padded(q, k, v, key_mask, scale: float, bias=None, window: int = 0) -> torch.Tensor:
    """Softmax attention with a key-padding mask, Hugging Face style.

    q, k, v: (B, heads, S, d); key_mask: (B, S) bool or 0/1, True = real token; bias: None or an additive
    (B or 1, heads, S, S) score bias (MPNet's relative positions), added before the mask as transformers does;
    window > 0: query column i sees only key columns j with |i - j| <= window (ModernBERT's local layers).
    Masked keys get the dtype's most negative value added, so a fully masked row is uniform,
    never NaN. Returns (B, heads, S, d).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    neg = torch.finfo(scores.dtype).min
    if key_mask is not None:
        additive = (1.0 - key_mask.to(scores.dtype))[:, None, None, :] * neg
        scores = scores + additive
    if window > 0:
        S = scores.shape[-1]
        columns = torch.arange(S, device=scores.device)
        outside = (columns[:, None] - columns[None, :]).abs() > window
        scores = scores.masked_fill(outside, neg)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


def disentangled(q, k, pos_key, pos_query, scale: float):
    """DeBERTa-v2's per-token position terms: c2p[t, h, r] = scale * q[t, h] . pos_key[r, h] and p2c[t, h, r] =
    scale * k[t, h] . pos_query[r, h]. q, k: (T, heads, d); pos_key, pos_query: (R, heads * d) or None. Returns
    (c2p, p2c), (T, heads, R) each or None, in float32 (float64 for float64 inputs)."""
    heads, d = q.shape[1], q.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)

    def table(x, pos):
        if pos is None:
            return None
        return (torch.einsum("thd,rhd->thr", x.to(dtype), pos.to(dtype).view(-1, heads, d)) * scale).contiguous()

    return table(q, pos_key), table(k, pos_query)


def _dense(bias, positions, dtype, rows=None):
    """The dense (..., heads, S, S) score bias in `dtype` of an AttentionBias or DisentangledBias (their contract's
    definitions) for tokens at `positions` (..., S) int; rows(t) moves a per-token table to that layout (None: it
    already is). Distances off the table (padding) are clamped."""
    pos = positions.long()
    if isinstance(bias, DisentangledBias):
        width = bias.index.shape[0]
        r = (pos[..., :, None] - pos[..., None, :] + (width - 1) // 2).clamp(0, width - 1)  # query - key
        cols = bias.index.long()[r].unsqueeze(-3)  # (..., 1, Sq, Sk)
        move = rows or (lambda t: t)
        out = 0
        if bias.c2p is not None:  # query i's row, column cols[i, j]
            out = out + torch.take_along_dim(move(bias.c2p).movedim(-2, -3), cols, dim=-1)
        if bias.p2c is not None:  # key j's row, column cols[i, j]
            p2c = move(bias.p2c).movedim(-2, -3)  # (..., heads, Sk, R)
            out = out + torch.take_along_dim(p2c, cols.transpose(-1, -2), dim=-1).transpose(-1, -2)
        return out.to(dtype) if torch.is_tensor(out) else None
    width = bias.table.shape[1]
    r = (pos[..., None, :] - pos[..., :, None] + (width - 1) // 2).clamp(0, width - 1)  # key - query
    return bias.table[:, r].movedim(0, -3).to(dtype)


def attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float,
              bias: AttentionBias | DisentangledBias | None = None, window: int = 0) -> torch.Tensor:
    """Variable-length attention on packed tokens.

    q, k, v: (T, heads, d); cu_seqlens: (B+1,) int32 sequence starts; max_seqlen: longest sequence; bias: the
    relative position bias (`backends.AttentionBias`) or None; window > 0: each token sees only the tokens of
    its sequence at most `window` places away. Each sequence attends to itself only. Returns (T, heads * d).
    """
    T, heads, d = q.shape
    B = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    mask = torch.arange(max_seqlen, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    idx = mask.flatten().nonzero().squeeze(1)

    def padded_rows(t):  # (T, ...) -> (B, max_seqlen, ...), zeros at padding
        buf = t.new_zeros(B * max_seqlen, *t.shape[1:]).index_copy_(0, idx, t)
        return buf.view(B, max_seqlen, *t.shape[1:])

    def to_padded(t):
        return padded_rows(t).transpose(1, 2)

    dense = None
    if bias is not None:
        dense = _dense(bias, padded_rows(bias.positions), q.dtype, padded_rows)
    out = attention_padded(to_padded(q), to_padded(k), to_padded(v), mask, scale, dense, window)
    out = out.transpose(1, 2).reshape(B * max_seqlen, heads * d)
    return out.index_select(0, idx)


def attention_loop(q, k, v, cu_seqlens, scale: float, bias: AttentionBias | None = None,
                   window: int = 0) -> torch.Tensor:
    """The same as `attention`, one sequence at a time (an independent check of the packing)."""
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        dense = None
        if bias is not None:
            dense = _dense(bias, bias.positions[start:end], q.dtype, lambda t: t[start:end])[None]
        o = attention_padded(qs, ks, vs, None, scale, dense, window)[0].transpose(0, 1)
        outs.append(o.reshape(end - start, -1))
    if not outs:
        return q.new_zeros(0, q.shape[1] * q.shape[2])
    return torch.cat(outs, 0)


def linear(x, weight, bias) -> torch.Tensor:
    """x: (T, K); weight: (N, K); bias: (N,). Returns (T, N)."""
    return F.linear(x, weight, bias)


def glu(h: torch.Tensor, act: str) -> torch.Tensor:
    """A gated FFN's gate (transformers' ModernBertMLP: input, gate = Wi(x).chunk(2)): h (..., 2N) with halves
    [a | b] -> act(a) * b, (..., N)."""
    a, b = h.chunk(2, dim=-1)
    return activation(a, act) * b


def linear_glu(x, weight, bias, act: str) -> torch.Tensor:
    """A gated FFN's first GEMM: act(x @ a.T + bias_a) * (x @ b.T + bias_b) for weight rows [a; b] (2N, K) and
    bias (2N,) or None. Returns (T, N)."""
    return glu(F.linear(x, weight, bias), act)


def linear_gelu(x, weight, bias, act: str = "gelu") -> torch.Tensor:
    """activation(x @ weight.T + bias); act one of ACTIVATIONS."""
    return activation(F.linear(x, weight, bias), act)


def linear_residual(x, weight, bias, residual) -> torch.Tensor:
    """(x @ weight.T + bias) + residual; residual: (T, N)."""
    return F.linear(x, weight, bias) + residual


def layernorm(x, weight, bias, eps: float, residual=None) -> torch.Tensor:
    """LayerNorm over the last dim of (x + residual) (residual optional)."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def lora_linear(x, weight, bias, pair=None) -> torch.Tensor:
    """F.linear(x, weight, bias) plus a LoRA pair's term (x A^T) B^T unmerged (A (r, K), B (N, r), the scale folded
    into B), as PEFT runs an adapter: the term in fp32 (fp64 for fp64 x), added in x's dtype."""
    y = F.linear(x, weight, bias)
    if pair is None:
        return y
    A, B = pair
    c = x.dtype if x.dtype == torch.float64 else torch.float32
    return y + ((x.to(c) @ A.to(x.device, c).T) @ B.to(x.device, c).T).to(y.dtype)


def pooler(cls_hidden, weight, bias, pair=None) -> torch.Tensor:
    """tanh(cls_hidden @ weight.T + bias) (with a LoRA pair's term, `lora_linear`); cls_hidden: (B, H)."""
    return torch.tanh(lora_linear(cls_hidden, weight, bias, pair))


SPARSE_POOLINGS = ("max", "sum")
SPARSE_ACTIVATIONS = ("relu", "log1p_relu")


def sparse_pool(x, weight, bias, cu_seqlens, pooling: str = "max", activation: str = "relu") -> torch.Tensor:
    """SPLADE's pooling (sentence-transformers' SpladePooling) of the MLM logits: for each sequence b, reduce (max or
    sum) over its tokens of log1p(relu(x @ weight.T + bias)) (activation "log1p_relu": log1p once more). x: (T, K);
    weight: (V, K); bias: (V,) or None; cu_seqlens: (B+1,) int32. Returns (B, V) in x's dtype; a sequence without
    tokens gives zeros."""
    if pooling not in SPARSE_POOLINGS or activation not in SPARSE_ACTIVATIONS:
        raise ValueError(f"pooling must be one of {SPARSE_POOLINGS} and activation one of {SPARSE_ACTIVATIONS}, "
                         f"got {pooling!r} and {activation!r}")
    bounds = cu_seqlens.tolist()
    out = x.new_zeros(len(bounds) - 1, weight.shape[0])
    for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            y = F.linear(x[start:end], weight, bias).relu().log1p()
            if activation == "log1p_relu":
                y = y.log1p()
            out[b] = y.amax(0) if pooling == "max" else y.sum(0)
    return out


# ----------------------------------------------------------------------------------------------
# The whole model, padded, exactly as transformers computes it.


# RoBERTa, XLM-R and MPNet count positions from a pad id (`create_position_ids_from_input_ids`); MPNet's embeddings
# fix that id at 1 whatever the config says (MPNetEmbeddings.padding_idx), the others take pad_token_id.
_COUNT_FROM_PAD = {"roberta": None, "xlm-roberta": None, "mpnet": 1}


def _position_ids(config, input_ids):
    """transformers' default position ids: 0..S-1 per row; for the models that count from the pad id, pad + the
    running count of non-pad tokens at real tokens and pad at pad tokens."""
    B, S = input_ids.shape
    if config.family not in _COUNT_FROM_PAD:
        return torch.arange(S, device=input_ids.device)[None, :].repeat(B, 1)
    pad = _COUNT_FROM_PAD[config.family]
    pad = config.pad_token_id if pad is None else pad
    not_pad = (input_ids != pad).to(torch.int64)
    return not_pad.cumsum(dim=1) * not_pad + pad


def deberta_relative(relative: torch.Tensor, config) -> torch.Tensor:
    """transformers' build_relative_position values: query-minus-key distances (int64), log-bucketed when the
    config buckets (position_buckets > 0)."""
    if config.position_buckets > 0 and config.max_relative_positions > 0:
        return log_bucket(relative, config.position_buckets, config.max_relative_positions)
    return relative


def deberta_rows(relative: torch.Tensor, config):
    """The rows of the position projections that transformers' disentangled_attention_bias gathers for a (S, S)
    matrix of query-minus-key distances `relative`: (c2p_pos, p2c_pos), (S, S) int64 each, entry [i, j] the row for
    query i and key j. c2p_pos = clamp(rel + span), p2c_pos = clamp(-rel + span) of the transposed matrix (transformers
    gathers p2c at key j, query i and transposes), both in [0, 2 span)."""
    span = deberta_span(config)
    rel = deberta_relative(relative, config)
    return (rel + span).clamp(0, 2 * span - 1), (-rel.transpose(-1, -2) + span).clamp(0, 2 * span - 1)


def rotate_padded(x, cos, sin):
    """RoPE on a padded (B, heads, S, d) tensor, transformers' way: cos/sin (B, S, d/2) fp32, half split."""
    return _rotate_halves(x, cos[:, None], sin[:, None])


def layer_forward(x, mask, layer: LayerWeights, num_heads: int, act: str, eps: float, bias=None, *, cos_sin=None,
                  window: int = 0, gated: bool = False, norm_first: bool = False, scale: float | None = None,
                  position_rows=None, lora: dict | None = None):
    """One encoder layer on a padded batch. x: (B, S, H); mask: (B, S) bool; bias: (1, heads, S, S) or None;
    cos_sin: RoPE tables (B, S, d/2) each, or None; window, gated, norm_first: as `layer`; scale: of q.k (None:
    1/sqrt(d)); position_rows: DeBERTa-v2's (c2p_pos, p2c_pos) of `deberta_rows` (the c2p / p2c terms from this
    layer's q and k and its pos_key / pos_query), or None; lora: an adapter's slots of this layer (`Adapter.layers`
    [i]: slot -> (A, B)) run unmerged (`lora_linear`), or None."""
    lora = lora or {}
    B, S, H = x.shape
    d = H // num_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def position_terms(q, k):  # transformers' disentangled_attention_bias, (B, heads, S, S)
        dtype = torch.promote_types(q.dtype, torch.float32)
        c2p_pos, p2c_pos = position_rows
        out = 0
        if layer.pos_key is not None:  # q_i . pos_key[c2p_pos[i, j]]
            pos = layer.pos_key.to(dtype).view(-1, num_heads, d).transpose(0, 1)  # (heads, 2 span, d)
            out = out + torch.take_along_dim(q.to(dtype) @ pos.transpose(-1, -2), c2p_pos[None, None], dim=-1) * scale
        if layer.pos_query is not None:  # k_j . pos_query[p2c_pos[i, j]]
            pos = layer.pos_query.to(dtype).view(-1, num_heads, d).transpose(0, 1)
            at_keys = torch.take_along_dim(k.to(dtype) @ pos.transpose(-1, -2), p2c_pos.t()[None, None], dim=-1)
            out = out + at_keys.transpose(-1, -2) * scale
        return out.to(q.dtype) if torch.is_tensor(out) else None

    def attend(h):
        q, k, v = (t.reshape(B, S, num_heads, d).transpose(1, 2)
                   for t in lora_linear(h, layer.qkv_weight, layer.qkv_bias, lora.get("qkv")).split(H, dim=-1))
        if cos_sin is not None:
            q, k = rotate_padded(q, *cos_sin), rotate_padded(k, *cos_sin)
        rel = bias if position_rows is None else position_terms(q, k)
        ctx = attention_padded(q, k, v, mask, scale, rel, window)
        return lora_linear(ctx.transpose(1, 2).reshape(B, S, H), layer.attn_out_weight, layer.attn_out_bias,
                           lora.get("attn_out"))

    def ffn(h):
        h = lora_linear(h, layer.ffn_in_weight, layer.ffn_in_bias, lora.get("ffn_in"))
        h = glu(h, act) if gated else activation(h, act)
        return lora_linear(h, layer.ffn_out_weight, layer.ffn_out_bias, lora.get("ffn_out"))

    if norm_first:
        h = x if layer.attn_ln_weight is None else layernorm(x, layer.attn_ln_weight, layer.attn_ln_bias, eps)
        x = x + attend(h)
        return x + ffn(layernorm(x, layer.ffn_ln_weight, layer.ffn_ln_bias, eps))
    x = layernorm(attend(x) + x, layer.attn_ln_weight, layer.attn_ln_bias, eps)
    return layernorm(ffn(x) + x, layer.ffn_ln_weight, layer.ffn_ln_bias, eps)


def forward(weights: ModelWeights, input_ids, attention_mask=None, token_type_ids=None,
            position_ids=None, output_hidden_states: bool = False, adapter=None):
    """Padded forward pass of the reference model.

    input_ids: (B, S) int64; attention_mask: (B, S) 0/1 (None = all real); token_type_ids and
    position_ids: (B, S) int64 or None (zeros / 0..S-1 like transformers); adapter: an `adapters.Adapter` loaded
    against `weights`, run unmerged on every row as PEFT runs it (not on DeBERTa's position projections), or None.
    Returns (last_hidden_state (B, S, H), pooler_output (B, H) or None, hidden_states tuple or None),
    hidden_states holding the (projected) embedding output and every layer's output when asked for.
    """
    cfg = weights.config
    B, S = input_ids.shape
    dev = weights.device
    if attention_mask is None:
        attention_mask = torch.ones(B, S, dtype=torch.long, device=dev)
    if token_type_ids is None:
        token_type_ids = torch.zeros(B, S, dtype=torch.long, device=dev)
    if position_ids is None:
        position_ids = _position_ids(cfg, input_ids)
    if cfg.hidden_act not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not one of the oracle's ({', '.join(HF_ACTIVATIONS)})")
    act = HF_ACTIVATIONS[cfg.hidden_act]
    mask = attention_mask.bool()
    emb = weights.embeddings
    x = embeddings(input_ids, position_ids, token_type_ids if emb.token_type is not None else None, emb,
                   cfg.layer_norm_eps, None if adapter is None else adapter.embeddings)
    if adapter is not None and any(slot.startswith("pos_") for slots in adapter.layers for slot in slots):
        raise NotImplementedError("the reference runs no LoRA on DeBERTa's position projections (pos_key, pos_query)")
    if emb.projection_weight is not None:
        x = lora_linear(x, emb.projection_weight, emb.projection_bias, None if adapter is None else adapter.projection)
    hidden = [x]
    columns = torch.arange(S, device=dev)
    bias = None
    if emb.relative_bias is not None:  # MPNet: the columns' key-minus-query buckets (its position ids play no part)
        buckets = relative_bucket(columns[None, :] - columns[:, None])  # (S, S)
        bias = emb.relative_bias[buckets].permute(2, 0, 1)[None].to(x.dtype)  # (1, heads, S, S)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # transformers' DeBERTa-v2 divides q.k by sqrt(d * (1 + len(pos_att_type))); every other family by sqrt(d)
    scale = 1.0 / math.sqrt(head_dim * (1 + len(cfg.pos_att_type)))
    position_rows = None
    if cfg.relative_attention and cfg.pos_att_type:  # DeBERTa-v2: query-minus-key column distances
        position_rows = deberta_rows(columns[:, None] - columns[None, :], cfg)
    windows = cfg.layer_windows or (0,) * len(weights.layers)
    tables = {}
    for i, layer in enumerate(weights.layers):
        extra = {}
        if cfg.rope_theta > 0:  # ModernBERT's sliding-window layers have their own base
            theta = cfg.local_rope_theta if windows[i] and cfg.local_rope_theta else cfg.rope_theta
            if theta not in tables:
                tables[theta] = rotary_tables(position_ids, theta, head_dim)
            extra = dict(cos_sin=tables[theta], window=windows[i], gated=cfg.gated_ffn, norm_first=cfg.norm_first)
        x = layer_forward(x, mask, layer, cfg.num_attention_heads, act, cfg.layer_norm_eps, bias, scale=scale,
                          position_rows=position_rows, lora=None if adapter is None else adapter.layers[i], **extra)
        hidden.append(x)
    if weights.final_ln_weight is not None:  # transformers' last hidden state is the normed one
        x = hidden[-1] = layernorm(x, weights.final_ln_weight, weights.final_ln_bias, cfg.layer_norm_eps)
    pooled = None
    if weights.pooler_weight is not None:
        pair = None if adapter is None else adapter.pooler
        pooled = pooler(x[:, 0], weights.pooler_weight, weights.pooler_bias, pair)
    return x, pooled, (tuple(hidden) if output_hidden_states else None)
