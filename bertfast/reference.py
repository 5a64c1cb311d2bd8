"""Eager reference: the exact math of Hugging Face's `BertModel`, in plain torch, in any dtype.

This module is the oracle (the torch backend wraps its ops; it imports nothing of the engine it checks: its
position ids are its own). Its op functions (`embeddings`, `qkv`, `attention`, `linear`, `linear_glu`, `linear_gelu`,
`linear_residual`, `layernorm`, `pooler`, `disentangled`, `sparse_pool`) define what every backend's op must compute
(the engine composes them into a layer once, `engine.compose_layer`), and `forward` runs the whole padded model the
way `transformers` does (additive key-padding mask, position ids ``0..S-1`` or from the ids; MPNet's relative
position bias; DeBERTa-v2's disentangled attention). Tests check `forward` against `transformers` itself; kernels and
backends are checked against the op functions. Nothing here is tuned for speed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import disentangled as dis, relative, rotary as rope
from .kernels import activation as act_table
from .backends import AttentionBias, DisentangledBias, Rotary
from .backends.weights import EmbeddingWeights, LayerWeights, ModelWeights

def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """kind: 'gelu' (exact erf), 'gelu_tanh' (tanh approximation) or 'relu' (also 'tanh', 'none')."""
    return act_table.apply(x, kind)


# ----------------------------------------------------------------------------------------------
# Ops on the packed token layout: x is [T, H] (T tokens of any number of sequences).


def embeddings(input_ids, position_ids, token_type_ids, emb: EmbeddingWeights, eps: float) -> torch.Tensor:
    """LayerNorm(word[ids] + token_type[tt] + position[pos]) (the embedding projection is separate).

    input_ids, position_ids, token_type_ids: (T,) int64 (token_type_ids may be None when the model
    has no token-type table). Returns (T, H) in the weights' dtype.
    """
    x = emb.word[input_ids]
    if emb.token_type is not None:
        x = x + emb.token_type[token_type_ids]
    if emb.position is not None:  # rotary models (ModernBERT, NomicBERT, GTE) have no position table
        x = x + emb.position[position_ids]
    return F.layer_norm(x, (x.shape[-1],), emb.ln_weight, emb.ln_bias, eps)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The half-split rotation in fp32, rounded once to x's dtype; cos/sin broadcast against x's halves."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


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
    """DeBERTa-v2's per-token position terms (c2p, p2c), (T, heads, R) each or None (`disentangled.tables`)."""
    return dis.tables(q, k, pos_key, pos_query, scale)


def _dense(bias, positions, dtype, pad=None):
    """The dense (..., heads, S, S) form of an AttentionBias or DisentangledBias for tokens at `positions`
    (..., S); pad(t) moves a per-token tensor to that layout (None: it already is)."""
    if isinstance(bias, DisentangledBias):
        move = pad or (lambda t: t)
        tables = [None if t is None else move(t) for t in (bias.c2p, bias.p2c)]
        return dis.dense_bias(DisentangledBias(*tables, bias.index, positions), positions, positions, dtype)
    return relative.dense_bias(bias, positions, positions, dtype)


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


def linear_glu(x, weight, bias, act: str) -> torch.Tensor:
    """A gated FFN's first GEMM: act(x @ a.T + bias_a) * (x @ b.T + bias_b) for weight rows [a; b] (2N, K) and
    bias (2N,) or None. Returns (T, N)."""
    return act_table.glu(F.linear(x, weight, bias), act)


def linear_gelu(x, weight, bias, act: str = "gelu") -> torch.Tensor:
    """activation(x @ weight.T + bias); act in activation.LAYER_IDS."""
    return activation(F.linear(x, weight, bias), act)


def linear_residual(x, weight, bias, residual) -> torch.Tensor:
    """(x @ weight.T + bias) + residual; residual: (T, N)."""
    return F.linear(x, weight, bias) + residual


def layernorm(x, weight, bias, eps: float, residual=None) -> torch.Tensor:
    """LayerNorm over the last dim of (x + residual) (residual optional)."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def pooler(cls_hidden, weight, bias) -> torch.Tensor:
    """tanh(cls_hidden @ weight.T + bias); cls_hidden: (B, H)."""
    return torch.tanh(F.linear(cls_hidden, weight, bias))


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


def _position_ids(config, input_ids):
    """transformers' default position ids: 0..S-1 per row; for the models that count from the pad id
    (RoBERTa, XLM-R, MPNet: `create_position_ids_from_input_ids`), pad + the running count of non-pad tokens at
    real tokens and pad at pad tokens."""
    B, S = input_ids.shape
    if not config.positions_from_input_ids:
        return torch.arange(S, device=input_ids.device)[None, :].repeat(B, 1)
    pad = config.position_padding_idx
    not_pad = (input_ids != pad).to(torch.int64)
    return not_pad.cumsum(dim=1) * not_pad + pad


def rotate_padded(x, cos, sin):
    """RoPE on a padded (B, heads, S, d) tensor, transformers' way: cos/sin (B, S, d/2) fp32, half split."""
    return _rotate_halves(x, cos[:, None], sin[:, None])


def layer_forward(x, mask, layer: LayerWeights, num_heads: int, act: str, eps: float, bias=None, *, cos_sin=None,
                  window: int = 0, gated: bool = False, norm_first: bool = False, scale: float | None = None,
                  distances: dis.DistanceIndex | None = None):
    """One encoder layer on a padded batch. x: (B, S, H); mask: (B, S) bool; bias: (1, heads, S, S) or None;
    cos_sin: RoPE tables (B, S, d/2) each, or None; window, gated, norm_first: as `layer`; scale: of q.k (None:
    1/sqrt(d)); distances: DeBERTa-v2's columns of the batch's distances (its c2p / p2c terms from this layer's
    q and k and the layer's pos_key / pos_query), or None."""
    B, S, H = x.shape
    d = H // num_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def attend(h):
        q, k, v = (t.reshape(B, S, num_heads, d).transpose(1, 2)
                   for t in F.linear(h, layer.qkv_weight, layer.qkv_bias).split(H, dim=-1))
        if cos_sin is not None:
            q, k = rotate_padded(q, *cos_sin), rotate_padded(k, *cos_sin)
        rel = bias
        if distances is not None:
            rows = [None if t is None else t[distances.lo:distances.hi] for t in (layer.pos_key, layer.pos_query)]
            flat = [t.transpose(1, 2).reshape(B * S, num_heads, d) for t in (q, k)]
            tables = [None if t is None else t.view(B, S, num_heads, -1) for t in disentangled(*flat, *rows, scale)]
            columns = torch.arange(S, device=x.device)
            rel = dis.dense_bias(DisentangledBias(*tables, distances.index, columns), columns, columns, q.dtype)
        ctx = attention_padded(q, k, v, mask, scale, rel, window)
        return linear(ctx.transpose(1, 2).reshape(B, S, H), layer.attn_out_weight, layer.attn_out_bias)

    def ffn(h):
        h = F.linear(h, layer.ffn_in_weight, layer.ffn_in_bias)
        h = act_table.glu(h, act) if gated else activation(h, act)
        return linear(h, layer.ffn_out_weight, layer.ffn_out_bias)

    if norm_first:
        h = x if layer.attn_ln_weight is None else layernorm(x, layer.attn_ln_weight, layer.attn_ln_bias, eps)
        x = x + attend(h)
        return x + ffn(layernorm(x, layer.ffn_ln_weight, layer.ffn_ln_bias, eps))
    x = layernorm(attend(x) + x, layer.attn_ln_weight, layer.attn_ln_bias, eps)
    return layernorm(ffn(x) + x, layer.ffn_ln_weight, layer.ffn_ln_bias, eps)


def forward(weights: ModelWeights, input_ids, attention_mask=None, token_type_ids=None,
            position_ids=None, output_hidden_states: bool = False):
    """Padded forward pass of the reference model.

    input_ids: (B, S) int64; attention_mask: (B, S) 0/1 (None = all real); token_type_ids and
    position_ids: (B, S) int64 or None (zeros / 0..S-1 like transformers).
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
    mask = attention_mask.bool()
    emb = weights.embeddings
    x = embeddings(input_ids, position_ids, token_type_ids if emb.token_type is not None else None, emb,
                   cfg.layer_norm_eps)
    if emb.projection_weight is not None:
        x = linear(x, emb.projection_weight, emb.projection_bias)
    hidden = [x]
    bias = None
    if emb.relative_bias is not None:  # transformers' MPNet: columns' relative positions, (1, heads, S, S)
        columns = torch.arange(S, device=dev)
        table = AttentionBias(relative.bias_table(emb.relative_bias, S), columns)
        bias = relative.dense_bias(table, columns, columns, x.dtype)[None]
    tables = {}
    if cfg.rotary:  # transformers: angles position * inv_freq in fp32, per base (ModernBERT: global, local)
        for theta in {cfg.rope_base(i) for i in range(len(weights.layers))}:
            angles = position_ids.float()[..., None] * rope.inverse_frequencies(theta, cfg.head_dim, dev)
            tables[theta] = (angles.cos(), angles.sin())
    distances = dis.distance_index(cfg, S, str(dev)) if cfg.disentangled else None
    for i, layer in enumerate(weights.layers):
        modern = dict(scale=cfg.attention_scale, distances=distances)
        if cfg.rotary:
            modern.update(cos_sin=tables[cfg.rope_base(i)], window=cfg.window(i), gated=cfg.gated_ffn,
                          norm_first=cfg.norm_first)
        x = layer_forward(x, mask, layer, cfg.num_attention_heads, cfg.activation, cfg.layer_norm_eps, bias,
                          **modern)
        hidden.append(x)
    if weights.final_ln_weight is not None:  # transformers' last hidden state is the normed one
        x = hidden[-1] = layernorm(x, weights.final_ln_weight, weights.final_ln_bias, cfg.layer_norm_eps)
    pooled = None
    if weights.pooler_weight is not None:
        pooled = pooler(x[:, 0], weights.pooler_weight, weights.pooler_bias)
    return x, pooled, (tuple(hidden) if output_hidden_states else None)
