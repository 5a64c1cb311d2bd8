"""The `torch-varlen` bench row: text-embeddings-inference's GPU recipe for BERT-family encoders, composed in torch.

The batch is unpadded to packed tokens once; every GEMM is a cuBLAS `F.linear` on the packed (T, H) rows (one fused
QKV per layer), attention is varlen flash attention over `cu_seqlens` (`torch.nn.attention.varlen.varlen_attn`), and
the output is padded back to (B, S, H) with zeros at padding. Wired for the absolute-position, post-LayerNorm families
TEI serves this way (`FAMILIES`). The weights are copies of the fp32 Hugging Face model's, cast once at build; the
reference model itself is never touched.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from bertfast.config import ModelConfig
from bertfast.engine import default_position_ids
from bertfast.kernels import activation
from bertfast.padding import pad, unpad

FAMILIES = ("bert", "roberta", "xlm-roberta")  # word + absolute position + token type embeddings, post-LN layers

# attention(q, k, v, cu_seqlens, max_seqlen, scale) -> (T, heads, head_dim); q, k, v: (T, heads, head_dim)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def varlen_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 scale: float) -> torch.Tensor:
    """The row's attention: torch's varlen flash attention (CUDA, fp16/bf16). q, k, v: (T, heads, head_dim);
    cu_seqlens: (batch+1,) int32. Returns (T, heads, head_dim)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale)


def sdpa_loop_for_tests(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, scale: float) -> torch.Tensor:
    """The tests' stand-in for `varlen_flash` on CPU (never the bench row's): SDPA per sequence, joined.
    Same shapes as `varlen_flash`."""
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, head_dim]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)


class VarlenEncoder:
    """A BERT-like Hugging Face model's encoder (no pooler) as packed-token torch ops. `model`: a transformers
    BertModel / RobertaModel / XLMRobertaModel (any dtype, read only); `config`: its ModelConfig; `attention`:
    `varlen_flash`, or `sdpa_loop_for_tests` in the CPU tests."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype, device,
                 attention: Attention = varlen_flash):
        if config.family not in FAMILIES:
            raise ValueError(f"the varlen peer is wired for {', '.join(FAMILIES)} only (this is {config.family})")
        state = getattr(model, "base_model", model).state_dict()

        def w(name: str) -> torch.Tensor:
            return state[name].detach().to(device=device, dtype=dtype, copy=True)

        self.config, self.attention = config, attention
        self.eps, self.heads = config.layer_norm_eps, config.num_attention_heads
        self.scale = config.attention_scale
        e = "embeddings."
        self.word, self.position = w(e + "word_embeddings.weight"), w(e + "position_embeddings.weight")
        types = e + "token_type_embeddings.weight"
        self.token_type = w(types) if types in state else None
        self.emb_ln = (w(e + "LayerNorm.weight"), w(e + "LayerNorm.bias"))
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layer.{i}."
            qkv = [p + f"attention.self.{n}" for n in ("query", "key", "value")]
            self.layers.append({
                # Q, K and V fused once: one GEMM per layer reads the packed rows once.
                "qkv_w": torch.cat([w(n + ".weight") for n in qkv]), "qkv_b": torch.cat([w(n + ".bias") for n in qkv]),
                "out_w": w(p + "attention.output.dense.weight"), "out_b": w(p + "attention.output.dense.bias"),
                "attn_ln": (w(p + "attention.output.LayerNorm.weight"), w(p + "attention.output.LayerNorm.bias")),
                "in_w": w(p + "intermediate.dense.weight"), "in_b": w(p + "intermediate.dense.bias"),
                "ffn_w": w(p + "output.dense.weight"), "ffn_b": w(p + "output.dense.bias"),
                "ffn_ln": (w(p + "output.LayerNorm.weight"), w(p + "output.LayerNorm.bias")),
            })

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask (1 = real), token_type_ids: (B, S) int64 -> last_hidden_state (B, S, H) in the
        weights' dtype, zeros at padded positions."""
        B, S = input_ids.shape
        # Positions from the padded ids, as transformers numbers them (RoBERTa counts real ids from pad + 1).
        positions = default_position_ids(self.config, input_ids)
        ids, indices, cu_seqlens, max_seqlen = unpad(input_ids, attention_mask)
        x = F.embedding(ids, self.word) + F.embedding(positions.reshape(-1)[indices], self.position)
        if self.token_type is not None:
            types = (torch.zeros_like(ids) if token_type_ids is None
                     else token_type_ids.reshape(-1).index_select(0, indices))
            x = x + F.embedding(types, self.token_type)
        x = F.layer_norm(x, x.shape[-1:], *self.emb_ln, self.eps)  # [T, H]
        for layer in self.layers:
            x = self._layer(x, layer, cu_seqlens, max_seqlen)
        return pad(x, indices, B, S)

    def _layer(self, x: torch.Tensor, layer: dict, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        T, H = x.shape
        qkv = F.linear(x, layer["qkv_w"], layer["qkv_b"]).view(T, 3, self.heads, H // self.heads)
        ctx = self.attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, self.scale)
        x = F.layer_norm(F.linear(ctx.reshape(T, H), layer["out_w"], layer["out_b"]) + x, (H,), *layer["attn_ln"],
                         self.eps)
        h = activation.apply(F.linear(x, layer["in_w"], layer["in_b"]), self.config.activation)
        return F.layer_norm(F.linear(h, layer["ffn_w"], layer["ffn_b"]) + x, (H,), *layer["ffn_ln"], self.eps)
