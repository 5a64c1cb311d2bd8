"""The op cases of `bertfast validate`'s sweep: each `OpCase` is one backend op on one shape, with the
inputs it draws and the call that runs it on a backend or on the reference. Weights come from tiny
random models (`tiny_config`, `random_weights`) so that every case goes through `backend.prepare`
exactly as the engine does; `op_cases` is the built-in list, covering every op in `OP_NAMES` and the
awkward shapes (length 1, non-block lengths, odd head dims, ragged and empty rows, strided inputs).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from bertfast.engine import run_layer

OP_NAMES = ("embeddings", "qkv", "attention", "linear_gelu", "linear_residual", "layernorm", "pooler", "layer")


def tiny_config(hidden, heads, intermediate=None, vocab=50, max_pos=64, act="gelu", eps=1e-12):
    """A one-layer BERT ModelConfig of the given sizes (activation `act`, a bertfast name)."""
    from bertfast.config import ACTIVATIONS, ModelConfig

    hf_act = {v: k for k, v in reversed(list(ACTIVATIONS.items()))}[act]
    return ModelConfig(family="bert", hidden_size=hidden, num_attention_heads=heads,
                       num_hidden_layers=1, intermediate_size=intermediate or 2 * hidden,
                       activation=act, layer_norm_eps=eps, vocab_size=vocab,
                       max_position_embeddings=max_pos, type_vocab_size=2, pad_token_id=0,
                       hidden_act=hf_act)


def random_weights(config, gen: torch.Generator):
    """fp64 CPU ModelWeights for `config`; scales keep every activation O(1)."""
    from bertfast.backends.weights import EmbeddingWeights, LayerWeights, ModelWeights

    H, I = config.hidden_size, config.intermediate_size

    def n(*shape, std=1.0, mean=0.0):
        # Drawn in fp32 (twice as fast as fp64 draws); every value is then exact in fp64.
        return torch.randn(*shape, generator=gen).double() * std + mean

    emb = EmbeddingWeights(word=n(config.vocab_size, H),
                           position=n(config.max_position_embeddings, H, std=0.5),
                           token_type=n(config.type_vocab_size, H, std=0.5),
                           ln_weight=n(H, std=0.1, mean=1.0), ln_bias=n(H, std=0.1))
    layer = LayerWeights(
        qkv_weight=n(3 * H, H, std=H ** -0.5), qkv_bias=n(3 * H, std=0.1),
        attn_out_weight=n(H, H, std=H ** -0.5), attn_out_bias=n(H, std=0.1),
        attn_ln_weight=n(H, std=0.1, mean=1.0), attn_ln_bias=n(H, std=0.1),
        ffn_in_weight=n(I, H, std=H ** -0.5), ffn_in_bias=n(I, std=0.1),
        ffn_out_weight=n(H, I, std=I ** -0.5), ffn_out_bias=n(H, std=0.1),
        ffn_ln_weight=n(H, std=0.1, mean=1.0), ffn_ln_bias=n(H, std=0.1))
    return ModelWeights(config, emb, [layer], n(H, H, std=H ** -0.5), n(H, std=0.1))


@dataclass
class OpCase:
    """One op on one shape.

    make(gen, cast) -> inputs dict: draws fp64 values from `gen` and passes every float tensor
    through `cast` (rounding to the run dtype, moving to the device) before making any view, so
    non-contiguous layouts survive the cast. call(ops, weights, inputs) runs the op on `ops` (a
    backend or the reference module) with that ModelWeights' tensors.
    """

    op: str
    label: str
    config: object
    make: Callable
    call: Callable
    noncontig: bool = False
    quick: bool = False

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.op}/{self.label}".encode())


def _lengths_to_cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def _embed_case(lengths, hidden, quick=False):
    # max_pos = the longest row, so the last position id sits at the table's limit.
    cfg = tiny_config(hidden, 1, vocab=97, max_pos=max(lengths))

    def make(gen, cast):
        T = sum(lengths)
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
        ids[0], ids[-1] = 0, cfg.vocab_size - 1
        pos = torch.cat([torch.arange(n) for n in lengths])
        tt = torch.randint(0, cfg.type_vocab_size, (T,), generator=gen)
        dev = cast(torch.zeros(())).device
        return dict(ids=ids.to(dev), pos=pos.to(dev), tt=tt.to(dev))

    def call(ops, w, inp):
        return ops.embeddings(inp["ids"], inp["pos"], inp["tt"], w.embeddings, cfg.layer_norm_eps)

    label = f"lens{'-'.join(map(str, lengths))}-H{hidden}"
    return OpCase("embeddings", label, cfg, make, call, quick=quick)


def _x(gen, cast, T, K, noncontig, std=1.0, mean=0.0):
    """(T, K) activations; non-contiguous = a column slice of a wider buffer (row stride K + 16)."""
    width = K + 16 if noncontig else K
    base = cast(torch.randn(T, width, generator=gen, dtype=torch.float64) * std + mean)
    return base[:, :K] if noncontig else base


def _qkv_case(T, hidden, heads, noncontig=False, quick=False):
    cfg = tiny_config(hidden, heads)

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        return tuple(ops.qkv(inp["x"], layer.qkv_weight, layer.qkv_bias, heads))

    label = f"T{T}-H{hidden}-h{heads}-d{hidden // heads}" + ("-strided" if noncontig else "")
    return OpCase("qkv", label, cfg, make, call, noncontig, quick)


def _attention_case(lengths, heads, head_dim, layout="contig", score_std=1.0, quick=False):
    """layout: 'contig' (T, heads, d) tensors, or 'qkv-views': q, k, v as the three slices of one
    (T, 3, heads, d) buffer, the layout a fused QKV projection naturally produces."""
    cfg = tiny_config(heads * head_dim, heads)
    cu = _lengths_to_cu(lengths)

    def make(gen, cast):
        T = cu[-1]
        dev = cast(torch.zeros(())).device
        # q is scaled so that scores q.k / sqrt(d) have std `score_std` (peaked softmax when large).
        if layout == "qkv-views":
            base = cast(torch.randn(T, 3, heads, head_dim, generator=gen, dtype=torch.float64)
                        * torch.tensor([score_std, 1.0, 1.0], dtype=torch.float64)[None, :, None, None])
            q, k, v = base[:, 0], base[:, 1], base[:, 2]
        else:
            q, k, v = (cast(torch.randn(T, heads, head_dim, generator=gen, dtype=torch.float64) * s)
                       for s in (score_std, 1.0, 1.0))
        return dict(q=q, k=k, v=v, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
                    max_seqlen=max(lengths))

    def call(ops, w, inp):
        return ops.attention(inp["q"], inp["k"], inp["v"], inp["cu_seqlens"], inp["max_seqlen"],
                             1.0 / math.sqrt(head_dim))

    label = f"cu{'-'.join(map(str, cu))}-h{heads}-d{head_dim}"
    if score_std != 1.0:
        label += f"-peaked{score_std:g}"
    if layout != "contig":
        label += "-" + layout
    return OpCase("attention", label, cfg, make, call, layout != "contig", quick)


def _linear_gelu_case(T, hidden, inter, act, noncontig=False, quick=False):
    cfg = tiny_config(hidden, 1, inter, act=act)

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        return ops.linear(inp["x"], layer.ffn_in_weight, layer.ffn_in_bias, act)

    label = f"T{T}-K{hidden}-N{inter}-{act}" + ("-strided" if noncontig else "")
    return OpCase("linear_gelu", label, cfg, make, call, noncontig, quick)


def _linear_residual_case(T, hidden, inter, which, noncontig=False, quick=False):
    """which: 'attn_out' (K = N = hidden) or 'ffn_out' (K = inter, N = hidden)."""
    cfg = tiny_config(hidden, 1, inter)
    K = hidden if which == "attn_out" else inter

    def make(gen, cast):
        return dict(x=_x(gen, cast, T, K, noncontig), residual=_x(gen, cast, T, hidden, noncontig))

    def call(ops, w, inp):
        layer = w.layers[0]
        weight, bias = ((layer.attn_out_weight, layer.attn_out_bias) if which == "attn_out"
                        else (layer.ffn_out_weight, layer.ffn_out_bias))
        return ops.linear(inp["x"], weight, bias, "none", inp["residual"])

    label = f"T{T}-K{K}-N{hidden}-{which}" + ("-strided" if noncontig else "")
    return OpCase("linear_residual", label, cfg, make, call, noncontig, quick)


def _layernorm_case(T, hidden, offset=0.0, std=1.0, eps=1e-12, noncontig=False, quick=False):
    """offset: rows centred far from zero (a one-pass E[x^2] - E[x]^2 variance cancels there);
    std: small spreads make the result sensitive to using the right eps."""
    cfg = tiny_config(hidden, 1, eps=eps)

    def make(gen, cast):
        # Per-row offsets vary around `offset` so that no two rows share a mean.
        mean = offset + torch.randn(T, 1, generator=gen, dtype=torch.float64) * (0.1 * std)
        return dict(x=_x(gen, cast, T, hidden, noncontig, std=std, mean=mean))

    def call(ops, w, inp):
        layer = w.layers[0]
        return ops.layernorm(inp["x"], layer.attn_ln_weight, layer.attn_ln_bias, eps)

    label = f"T{T}-H{hidden}"
    if offset:
        label += f"-offset{offset:g}"
    if std != 1.0:
        label += f"-std{std:g}"
    label += f"-eps{eps:g}" + ("-strided" if noncontig else "")
    return OpCase("layernorm", label, cfg, make, call, noncontig, quick)


def _pooler_case(B, hidden, noncontig=False, quick=False):
    cfg = tiny_config(hidden, 1)

    def make(gen, cast):
        if noncontig:  # the CLS column of a padded (B, S, H) batch: row stride S * H
            return dict(cls=cast(torch.randn(B, 5, hidden, generator=gen, dtype=torch.float64))[:, 0])
        return dict(cls=cast(torch.randn(B, hidden, generator=gen, dtype=torch.float64)))

    def call(ops, w, inp):
        return ops.linear(inp["cls"], w.pooler_weight, w.pooler_bias, "tanh")

    label = f"B{B}-H{hidden}" + ("-strided" if noncontig else "")
    return OpCase("pooler", label, cfg, make, call, noncontig, quick)


def _layer_case(lengths, hidden, heads, inter, act="gelu", quick=False):
    """A whole encoder layer as the engine runs it (`engine.run_layer`: the backend's `whole_layer` where it
    offers one, else `engine.compose_layer` over its ops) on a ragged batch."""
    cfg = tiny_config(hidden, heads, inter, act=act)
    cu = _lengths_to_cu(lengths)

    def make(gen, cast):
        dev = cast(torch.zeros(())).device
        return dict(x=_x(gen, cast, cu[-1], hidden, False),
                    cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev), max_seqlen=max(lengths))

    def call(ops, w, inp):
        return run_layer(ops, inp["x"], w.layers[0], inp["cu_seqlens"], inp["max_seqlen"], heads,
                         1.0 / math.sqrt(hidden // heads), cfg.layer_norm_eps, act)

    label = f"cu{'-'.join(map(str, cu))}-H{hidden}-h{heads}-I{inter}-{act}"
    return OpCase("layer", label, cfg, make, call, quick=quick)


def op_cases(quick: bool = False) -> list[OpCase]:
    """The built-in sweep. `quick` keeps the cases marked quick: still every op and the awkward
    shapes (length 1, a non-block length, an odd head dim, ragged cu_seqlens with an empty row)."""
    cases = [
        _embed_case([1, 7, 65], 64, quick=True),
        _embed_case([129, 63], 80),
        _qkv_case(1, 64, 2, quick=True),
        _qkv_case(65, 312, 12),  # head dim 26
        _qkv_case(129, 80, 1),
        _qkv_case(7, 128, 1),
        _qkv_case(63, 64, 2, noncontig=True, quick=True),
        _attention_case([1, 16, 63, 1], 2, 32, quick=True),  # cu_seqlens [0, 1, 17, 80, 81]
        _attention_case([0, 1, 16, 0, 63, 1], 2, 64, layout="qkv-views", quick=True),  # empty rows
        _attention_case([7, 65], 2, 26, quick=True),
        _attention_case([63, 129], 1, 64),
        _attention_case([65], 1, 80),
        _attention_case([1, 7, 129], 1, 128),
        _attention_case([7, 65], 2, 32, score_std=8.0),
        _linear_residual_case(1, 64, 128, "attn_out", quick=True),
        _linear_residual_case(65, 80, 200, "ffn_out", quick=True),
        _linear_residual_case(129, 312, 1200, "ffn_out"),
        _linear_residual_case(63, 64, 128, "ffn_out", noncontig=True, quick=True),
        _layernorm_case(1, 64, quick=True),
        _layernorm_case(65, 384, offset=100.0, quick=True),
        _layernorm_case(129, 312, std=0.01, quick=True),
        _layernorm_case(7, 80, offset=10.0, std=0.1, eps=1e-5),
        _layernorm_case(63, 64, noncontig=True, quick=True),
        _pooler_case(1, 64, quick=True),
        _pooler_case(5, 80),
        _pooler_case(3, 64, noncontig=True, quick=True),
        _layer_case([1, 16, 0, 5], 64, 2, 128, quick=True),
        _layer_case([7, 65], 312, 12, 1200, "gelu_tanh"),  # head dim 26
        _layer_case([129], 160, 2, 320, "relu"),  # head dim 80
    ]
    for act in ("gelu", "gelu_tanh", "relu"):
        cases += [_linear_gelu_case(1, 64, 256, act, quick=act == "gelu"),
                  _linear_gelu_case(65, 80, 200, act, quick=True),
                  _linear_gelu_case(129, 312, 1200, act)]
    cases.append(_linear_gelu_case(63, 64, 256, "gelu", noncontig=True, quick=True))
    cases = [c for c in cases if c.quick] if quick else cases
    return sorted(cases, key=lambda c: OP_NAMES.index(c.op))

