"""The engine: one forward pass over the real tokens only, the same for every backend.

unpad (`pack`) -> embed (-> projection) -> layers (-> final norm) (`encode`) -> pad -> pooler. `encode` reads only
the packed tokens, so a CUDA graph of it can be replayed per token-count bucket (`backends.cuda.graphs`). What every
layer shares is computed once per forward, inside `encode`: MPNet's relative position bias, DeBERTa-v2's distance
columns (its c2p / p2c terms come per layer from q and k, `disentangled`), the RoPE tables of
rotary models (one per base). A layer is `compose_layer` over the backend's ops: post-LayerNorm as in BERT (qkv ->
varlen attention -> linear + residual -> layernorm -> linear + activation -> linear + residual -> layernorm), or
pre-LayerNorm as in ModernBERT (layernorm -> qkv -> attention -> linear + residual -> layernorm -> linear -> linear
+ residual); rotary models rotate q and k in `qkv`, gated FFNs (GeGLU, SwiGLU) gate in the first FFN linear,
ModernBERT's local layers pass their window to attention. A plain BERT layer runs whole where the backend offers it
(`Backend.whole_layer`: the same kernels in the same order). A key mask (`key_bias`) leaves tokens out of every
softmax while still computing them (ColBERT's query expansion). LoRA adapters chosen per row (`adapters`) add
each slot's delta, per row from its own adapter, into the slot's GEMM epilogue before the activation (the ops'
`addend`); a plain BERT layer with adapters still runs whole where the backend's whole layer takes them (the cpu
backend's: the same terms, the same bits), else it is composed from the ops. Inputs are assumed validated
(`inputs.check_inputs`); padded positions of the outputs hold 0.
"""

from __future__ import annotations


import torch

from . import disentangled as dis, relative, rotary as rope
from .adapters import Adapter
from .adapters_rows import RowAdapters, pack_adapter
from .backends import AttentionBias, Backend, DisentangledBias, Rotary, Tokens
from .backends.cuda.graphs import GraphRunner
from .backends.weights import LayerWeights, ModelWeights
from .config import ConfigError
from .padding import pad, unpad


def default_position_ids(config, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids transformers uses when none are given. input_ids: (B, S) -> (B, S) int64.

    Columns 0..S-1, except RoBERTa/XLM-R/MPNet: real tokens (ids != pad) count up from pad + 1 and pad
    tokens get pad (fairseq's make_positions), pad = `config.position_padding_idx`.
    """
    B, S = input_ids.shape
    if config.positions_from_input_ids:
        pad = config.position_padding_idx
        real = input_ids.ne(pad).long()
        return torch.cumsum(real, dim=1) * real + pad
    return torch.arange(S, device=input_ids.device).expand(B, S)


# The score a masked key gets: its exp underflows to exactly 0 beside any real score (transformers' additive mask).
MASKED_KEY = -1e30


def key_bias(keys: torch.Tensor, heads: int, width: int, columns: torch.Tensor) -> DisentangledBias:
    """Tokens no token attends to, as attention terms every backend takes: p2c[u, h, 0] is 0 for a key u and
    MASKED_KEY for the others, which still attend to the keys (ColBERT's [MASK] query expansion when the model does
    not attend to it). keys: (T,) bool; columns: (T,) int32, each token's column in the padded batch of `width`."""
    p2c = torch.where(keys, 0.0, MASKED_KEY).to(torch.float32)
    p2c = p2c[:, None, None].expand(-1, heads, 1).contiguous()
    index = torch.zeros(2 * width - 1, dtype=torch.int32, device=keys.device)
    return DisentangledBias(None, p2c, index, columns)


def compose_layer(ops: Backend, x, layer: LayerWeights, cu_seqlens, max_seqlen: int, heads: int,
                  scale: float, eps: float, act: str, bias: AttentionBias | None = None, *,
                  rotary: Rotary | None = None, window: int = 0, gated: bool = False,
                  norm_first: bool = False, disentangled: tuple | None = None, lora=None) -> torch.Tensor:
    """One encoder layer on x (T, H) from the backend's ops; cu_seqlens (B+1,) int32; bias: the relative position
    bias (MPNet) or None; rotary: RoPE tables for q and k or None; window: 0 (global) or the sliding window;
    gated: a GLU FFN; norm_first: pre-LayerNorm (ModernBERT; attn_ln None = no norm before attention);
    disentangled: DeBERTa-v2's (DistanceIndex, positions (T,) int32, token_windows): the layer's c2p / p2c
    terms from its q and k (`ops.disentangled`) become the attention's bias; lora: None, or the layer's
    `adapters_rows.LayerAdapters`: (slot, x) -> the slot's per-row deltas (T, N) float32 or None, handed to the op as
    its `addend`, and the adapted rows' position terms."""
    qkv_extra = {} if rotary is None else {"rotary": rotary}
    attn_extra = {"window": window} if window else {}
    ffn_extra = {"gated": True} if gated else {}
    if norm_first:
        h = x if layer.attn_ln_weight is None else ops.layernorm(x, layer.attn_ln_weight, layer.attn_ln_bias, eps)
        q, k, v = ops.qkv(h, layer.qkv_weight, layer.qkv_bias, heads, **qkv_extra, **_addend(lora, "qkv", h))
        ctx = ops.attention(q, k, v, cu_seqlens, max_seqlen, scale, bias, **attn_extra)
        x = ops.linear(ctx, layer.attn_out_weight, layer.attn_out_bias, "none", x, **_addend(lora, "attn_out", ctx))
        h = ops.layernorm(x, layer.ffn_ln_weight, layer.ffn_ln_bias, eps)
        h = ops.linear(h, layer.ffn_in_weight, layer.ffn_in_bias, act, **ffn_extra, **_addend(lora, "ffn_in", h))
        return ops.linear(h, layer.ffn_out_weight, layer.ffn_out_bias, "none", x, **_addend(lora, "ffn_out", h))
    q, k, v = ops.qkv(x, layer.qkv_weight, layer.qkv_bias, heads, **qkv_extra, **_addend(lora, "qkv", x))
    if disentangled is not None:
        index, positions, windows = disentangled
        bias = dis.layer_bias(ops, q, k, layer.pos_key, layer.pos_query, index, positions, scale, windows)
        if lora is not None:  # adapted position projections: their rows' terms from their adapters' tables
            bias = lora.positions(bias, q, k, index, scale, windows)
    ctx = ops.attention(q, k, v, cu_seqlens, max_seqlen, scale, bias, **attn_extra)
    x = ops.layernorm(ops.linear(ctx, layer.attn_out_weight, layer.attn_out_bias, "none", x,
                                 **_addend(lora, "attn_out", ctx)), layer.attn_ln_weight, layer.attn_ln_bias, eps)
    h = ops.linear(x, layer.ffn_in_weight, layer.ffn_in_bias, act, **ffn_extra, **_addend(lora, "ffn_in", x))
    return ops.layernorm(ops.linear(h, layer.ffn_out_weight, layer.ffn_out_bias, "none", x,
                                    **_addend(lora, "ffn_out", h)), layer.ffn_ln_weight, layer.ffn_ln_bias, eps)


def _addend(lora, slot: str, x) -> dict:
    """The op's addend keyword for a slot: none where no adapter of the forward adapts it (the op as without LoRA)."""
    delta = None if lora is None else lora(slot, x)
    return {} if delta is None else {"addend": delta}


def run_layer(ops: Backend, x, layer: LayerWeights, cu_seqlens, max_seqlen: int, heads: int, scale: float,
              eps: float, act: str, bias: AttentionBias | None = None, carry=None, **modern) -> torch.Tensor:
    """The layer whole where the backend offers it for these tokens (plain BERT layers: no `modern` keyword of
    `compose_layer` set but `lora`, which the backend's whole layer must then take), else `compose_layer`; carry:
    `Backend.layer_carry`'s, the same for each layer of a forward."""
    lora = modern.get("lora")
    plain = not any(v for k, v in modern.items() if k != "lora") and not isinstance(bias, DisentangledBias)
    whole = ops.whole_layer(x, layer, lora=lora) if plain else None
    if whole is not None:
        return whole(x, cu_seqlens, int(max_seqlen), float(scale), bias, carry)
    return compose_layer(ops, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, bias, **modern)


def to_device(tokens: Tokens, indices: torch.Tensor, device) -> tuple[Tokens, torch.Tensor]:
    """`tokens` and `indices` packed on the host, moved to `device` in one copy: the int64 fields, then the int32 ones,
    as the bytes of one pinned buffer (asynchronous), each field a view of it there."""
    wide = [t for t in (tokens.ids, tokens.positions, tokens.types, indices) if t is not None]
    narrow = [t for t in (tokens.cu_seqlens, tokens.columns) if t is not None]
    fields = [t.reshape(-1).to(torch.int64) for t in wide] + [t.reshape(-1).to(torch.int32) for t in narrow]
    flat = torch.cat([t.view(torch.uint8) for t in fields])  # the int64 part first: every field stays aligned
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    moved = [part.view(t.dtype) for part, t in zip(flat.split([t.numel() * t.element_size() for t in fields]), fields)]
    ids, positions = moved[0], moved[1]
    types = moved[2] if tokens.types is not None else None
    indices = moved[len(wide) - 1]
    cu_seqlens = moved[len(wide)]
    columns = moved[len(wide) + 1] if tokens.columns is not None else None
    return tokens._replace(ids=ids, positions=positions, types=types, columns=columns, cu_seqlens=cu_seqlens), indices


class Engine:
    """One model on one backend. `forward` = `pack` (unpad) -> `run` (the layer stack on the packed tokens:
    `encode`, or its CUDA-graph replay per token-count bucket, `backends.cuda.graphs.GraphRunner`) -> pad -> pooler.

    graphs: None replays CUDA graphs where the backend's launches can be captured on the weights' device (the
    triton backend on CUDA), True requires that (ValueError where impossible), False always launches eagerly."""

    def __init__(self, weights: ModelWeights, backend: Backend, graphs: bool | None = None):
        self.config = weights.config
        if self.config.family in backend.unsupported_families:
            raise ConfigError(f"backend {backend.name!r} does not run {self.config.family} models yet: "
                              f"{backend.unsupported_families[self.config.family]}")
        self.backend = backend
        self.weights = backend.prepare(weights)
        reason = backend.graph_unavailable_reason(self.weights.device)
        if graphs and reason is not None:
            raise ValueError(f"graphs=True: {reason}")
        use_graphs = reason is None if graphs is None else bool(graphs)
        self.run = GraphRunner(self.encode, self.weights.device, strict=bool(graphs)) if use_graphs else self.encode

    @property
    def graphs(self) -> bool:
        """Whether forwards replay CUDA graphs (per token-count bucket)."""
        return isinstance(self.run, GraphRunner)

    def pack(self, input_ids, attention_mask, token_type_ids=None, position_ids=None):
        """(B, S) int64 inputs -> (Tokens of the real tokens, their indices (T,) int64 into the flat B*S)."""
        cfg, w = self.config, self.weights
        S = input_ids.shape[1]
        ids, indices, cu_seqlens, max_seqlen = unpad(input_ids, attention_mask)
        if position_ids is None:
            position_ids = default_position_ids(cfg, input_ids)
        positions = position_ids.reshape(-1)[indices]
        types = None
        if w.embeddings.token_type is not None:
            types = (torch.zeros_like(ids) if token_type_ids is None
                     else token_type_ids.reshape(-1)[indices])
        relative = w.embeddings.relative_bias is not None or cfg.disentangled
        columns = (indices % S).to(torch.int32) if relative else None
        return Tokens(ids, positions, types, columns, cu_seqlens, max_seqlen, S), indices

    def encode(self, tokens: Tokens, output_hidden_states: bool = False,
               keys: DisentangledBias | None = None, lora: RowAdapters | None = None) -> tuple[torch.Tensor, ...]:
        """The layer stack on packed tokens: (x,) (T, H) after the last layer (and the final norm), or with
        output_hidden_states every hidden state, the embeddings first and x last; in the residual stream's dtype
        (`Backend.stream_dtype`). Reads only `tokens` and the weights (and `keys`, a `key_bias`), and its launches
        depend on the packed sizes alone (what CUDA-graph capture needs). lora: the rows' adapters (eager only)."""
        cfg, ops, w = self.config, self.backend, self.weights
        cu_seqlens, max_seqlen = tokens.cu_seqlens, tokens.max_seqlen
        x = ops.embeddings(tokens.ids, tokens.positions, tokens.types, w.embeddings, cfg.layer_norm_eps)
        if lora is not None:  # the rows of adapters of the embedding tables, from their adapted rows
            x = lora.embeddings(ops, x, tokens, w.embeddings, cfg.layer_norm_eps)
        if w.embeddings.projection_weight is not None:  # factorised embeddings (ELECTRA, ALBERT)
            extra = {} if lora is None else _addend(lora.layer(ops, None), "projection", x)
            x = ops.linear(x, w.embeddings.projection_weight, w.embeddings.projection_bias, **extra)
        x = x.to(ops.stream_dtype(w.dtype))  # the residual stream (fp32 under bf16 on the cpu backend)
        hidden = [x] if output_hidden_states else None
        heads, eps, act = cfg.num_attention_heads, cfg.layer_norm_eps, cfg.activation
        scale = cfg.attention_scale
        bias, common = None, {}
        if w.embeddings.relative_bias is not None:  # MPNet: once per forward, shared by every layer
            bias = relative.attention_bias(w.embeddings.relative_bias, tokens.columns, tokens.width)
        if keys is not None:
            if bias is not None or cfg.disentangled:
                raise ConfigError(f"{cfg.family}: a key mask (query expansion that is not attended to) needs an "
                                  "attention without a relative position bias (not MPNet or DeBERTa-v2)")
            bias = keys
        tables = {}
        if cfg.rotary:  # once per forward and base: ModernBERT's local layers have their own
            tables = {theta: rope.tables(tokens.positions, theta, cfg.head_dim)
                      for theta in {cfg.rope_base(i) for i in range(len(w.layers))}}
        if cfg.disentangled:  # DeBERTa-v2: the distances' columns once per forward; the terms per layer
            index = dis.distance_index(cfg, tokens.width, str(x.device))
            windows = dis.token_windows(index, tokens.columns, cu_seqlens)
            common = dict(disentangled=(index, tokens.columns, windows))
        carry = ops.layer_carry()
        for i, layer in enumerate(w.layers):
            modern = dict(common)
            if cfg.rotary:
                modern = dict(rotary=tables[cfg.rope_base(i)], window=cfg.window(i), gated=cfg.gated_ffn,
                              norm_first=cfg.norm_first)
            if lora is not None:
                modern["lora"] = lora.layer(ops, i)
            x = run_layer(ops, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, bias, carry, **modern)
            if hidden is not None:
                hidden.append(x)
        if w.final_ln_weight is not None:  # pre-LayerNorm models end with a norm (transformers: in the last state too)
            x = ops.layernorm(x, w.final_ln_weight, w.final_ln_bias, eps)
            if hidden is not None:
                hidden[-1] = x
        return tuple(hidden) if hidden is not None else (x,)

    def _pack_on_device(self, input_ids, attention_mask, token_type_ids, position_ids):
        """`pack`, then on the weights' device (packed on the host: `Encoder.forward` on a GPU)."""
        tokens, indices = self.pack(input_ids, attention_mask, token_type_ids, position_ids)
        if tokens.ids.device != self.weights.device:
            tokens, indices = to_device(tokens, indices, self.weights.device)
        return tokens, indices

    def pack_adapter(self, adapter: Adapter) -> Adapter:
        """`adapter` (loaded against `self.weights`) in this backend's form for `forward`'s adapters; raises
        NotImplementedError where the backend runs no adapters (`Backend.no_adapters`)."""
        if self.backend.no_adapters is not None:
            raise NotImplementedError(self.backend.no_adapters)
        device = self.weights.device
        return pack_adapter(adapter, self.weights, lambda A, B, segments, layer=True: self.backend.pack_lora(
            A.to(device).contiguous(), B.to(device).contiguous(), segments, layer=layer))

    def _row_adapters(self, adapters, tokens: Tokens) -> RowAdapters | None:
        """None where no row has an adapter (the forward as without LoRA: whole layers, CUDA graphs)."""
        if adapters is None:
            return None
        if len(adapters) != tokens.cu_seqlens.numel() - 1:
            raise ValueError(f"{len(adapters)} adapters for {tokens.cu_seqlens.numel() - 1} rows: give one (or None) "
                             "per row")
        return RowAdapters(adapters, tokens.cu_seqlens, self.weights.device) if any(
            a is not None for a in adapters) else None

    @torch.inference_mode()
    def forward_packed(self, input_ids, attention_mask, token_type_ids=None, position_ids=None, adapters=None):
        """The last state of the real tokens as the layers leave it, without padding it back: (states (T, H) in the
        residual stream's dtype, in row-major order, cu_seqlens (B + 1,) int32: row b's tokens are
        [cu_seqlens[b], cu_seqlens[b + 1])). Inputs as `forward` (no key mask)."""
        tokens, _ = self._pack_on_device(input_ids, attention_mask, token_type_ids, position_ids)
        lora = self._row_adapters(adapters, tokens)
        states = self.run(tokens, False) if lora is None else self.encode(tokens, False, lora=lora)
        return states[-1], tokens.cu_seqlens

    @torch.inference_mode()
    def forward(self, input_ids, attention_mask, token_type_ids=None, position_ids=None,
                output_hidden_states: bool = False, pool: bool = True, stream: bool = False, key_mask=None,
                adapters=None):
        """input_ids, attention_mask, token_type_ids, position_ids: (B, S) int64 (mask 0/1). key_mask: (B, S) 0/1 or
        None: the tokens attended to, where fewer than the attention mask's (`key_bias`; each row keeps a key).
        adapters: None, or B entries, each an adapter of `pack_adapter` or None (the base model) for its row.

        Returns (last_hidden_state (B, S, H), pooler_output (B, H) or None (no pooler, or pool=False),
        hidden_states or None); padded positions hold 0. The states have the weights' dtype, or with stream=True
        the residual stream's (fp32 under bf16 on the cpu backend: what sentence embeddings pool), and so the pooler's.
        """
        w = self.weights
        B, S = input_ids.shape
        tokens, indices = self._pack_on_device(input_ids, attention_mask, token_type_ids, position_ids)
        lora = self._row_adapters(adapters, tokens)
        if key_mask is None and lora is None:
            states = self.run(tokens, output_hidden_states)
        elif key_mask is None:  # eagerly: the CUDA graphs of `encode` take no adapters
            states = self.encode(tokens, output_hidden_states, lora=lora)
        else:  # eagerly: the CUDA graphs of `encode` take no key mask
            key_mask = key_mask.to(attention_mask.device).bool()
            if key_mask.shape != attention_mask.shape or bool((key_mask & ~attention_mask.bool()).any()):
                raise ValueError(f"key_mask {tuple(key_mask.shape)} must mark a subset of attention_mask's tokens")
            if not bool(key_mask[attention_mask.bool().any(1)].any(1).all()):
                raise ValueError("key_mask leaves a sequence without a token to attend to")
            keys = key_mask.to(indices.device).reshape(-1)[indices]
            bias = key_bias(keys, self.config.num_attention_heads, S, (indices % S).to(torch.int32))
            states = self.encode(tokens, output_hidden_states, keys=bias, lora=lora)
        if not stream:
            states = tuple(h.to(w.dtype) for h in states)
        last = pad(states[-1], indices, B, S)
        pooled = None
        if pool and w.pooler_weight is not None:  # tanh(W h[CLS] + b)
            cls = last[:, 0].contiguous()
            extra = {} if lora is None else _addend(lora.layer(self.backend, None), "pooler", cls)
            # A zero residual in the stream's dtype keeps tanh's output unrounded where the stream is wider.
            residual = torch.zeros_like(cls) if stream and cls.dtype != w.dtype else None
            pooled = self.backend.linear(cls, w.pooler_weight, w.pooler_bias, "tanh", residual, **extra)
        hidden = tuple(pad(h, indices, B, S) for h in states) if output_hidden_states else None
        return last, pooled, hidden
