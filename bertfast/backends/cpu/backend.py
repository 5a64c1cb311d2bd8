"""The "cpu" backend: native kernels from `bertfast._C` (csrc/) on the packed [T, H] token layout.

Embedding + LayerNorm, varlen attention (reading q/k/v in place from the fused QKV output; sliding window,
DeBERTa-v2's c2p / p2c terms from per-token tables, `_C.position_scores`,
relative position bias), SPLADE's pooling in the vocabulary GEMM (`_C.sparse_pool`), RoPE on q and k (in place,
right after the QKV GEMM), the GLU gate and LayerNorm
run in C++ (code per ISA tier, `isa`). GEMMs run on the extension's kernel at every token count, on weights
packed once in `prepare` (`linear.PackedLinear`, or `quant.QuantLinear` under int8). A plain BERT layer runs
whole in C++ (`_C.Layer`, csrc/cpu/layer/layer.cpp): the same kernels in the same order, without the Python between
them, LoRA adapters per row included. fp32 and bf16; with quantize="int8" (`dtype="int8"`) the four per-layer
GEMMs run int8 (docs/int8.md), everything else fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from ...kernels import activation
from ..contract import Backend, DisentangledBias, Precision, Rotary
from ..weights import LayerWeights, ModelWeights
from . import isa, linear, lora, quant
from .ext import _C, IMPORT_ERROR
from .lora import LayerSlots

# Caps (`isa.active_cap`) without native bf16 dot products where the backend's bf16 forward measured slower
# than its fp32 one (docs/cpu-gemm.md#bf16-slower-tiers).
BF16_SLOWER_TIERS: tuple[str, ...] = ("portable", isa.NO_BF16)


class CpuBackend(Backend):
    name = "cpu"
    dtypes = (torch.float32, torch.bfloat16)
    quantizations = ("int8",)
    sparse_pool_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def unavailable_reason(cls, device):
        if device != "cpu":
            return f"the cpu backend runs on CPU tensors only, not on device {device!r}"
        if _C is None:
            return f"native extension not built: run bash install.sh ({IMPORT_ERROR})"
        return None

    def check_dtype(self, dtype):
        if dtype not in self.dtypes:
            raise ValueError(
                f"backend 'cpu' does not support dtype {dtype}; it supports float32 and bfloat16 "
                "(use dtype=torch.bfloat16 for reduced precision, or backend='torch' for other dtypes)"
            )

    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """Pack every linear weight once (PackedLinear, or QuantLinear for the layers' GEMMs under
        int8); everything else is made contiguous."""
        self.check_dtype(weights.dtype)
        if weights.device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs weights on the CPU, got {weights.device}")
        if self.quantize == "int8" and weights.dtype != torch.float32:
            raise ValueError(f"int8 quantization starts from float32 weights, got {weights.dtype}")
        self._dtype = weights.dtype  # pack_lora's
        # The stream's tensors (LayerNorms, position and token type tables) in its dtype: fp32 under bf16, as loaded
        # from the checkpoint (`Encoder.from_pretrained`) or cast from bf16 here.
        stream = self.stream_dtype(weights.dtype)
        contiguous = weights.map(lambda t: t.contiguous(), stream=lambda t: t.to(stream).contiguous())
        pack = quant.QuantLinear.from_float if self.quantize == "int8" else linear.PackedLinear
        seen: dict[int, LayerWeights] = {}
        layers = []
        for layer in contiguous.layers:
            if id(layer) not in seen:  # shared layers stay shared
                seen[id(layer)] = dataclasses.replace(
                    layer,
                    qkv_weight=pack(layer.qkv_weight),
                    attn_out_weight=pack(layer.attn_out_weight),
                    ffn_in_weight=pack(layer.ffn_in_weight),
                    ffn_out_weight=pack(layer.ffn_out_weight),
                )
            layers.append(seen[id(layer)])
        pooler = None if contiguous.pooler_weight is None else linear.PackedLinear(contiguous.pooler_weight)
        # Each distinct plain BERT layer also as one C++ object running it whole on the extension's GEMMs.
        self._whole = {id(layer): self._whole_layer(layer, weights.config) for layer in seen.values()
                       if _fits_whole_layer(layer, weights.config)}
        return dataclasses.replace(contiguous, layers=layers, pooler_weight=pooler)

    def stream_dtype(self, dtype):
        """fp32 under bf16: the residual stream, the LayerNorms and the position and token type tables stay fp32
        (`STREAM_TENSORS`), bf16 is the GEMMs' and attention's operands (rounded once from the stream where a GEMM
        reads it). A bf16 stream cost ~4x the error: BERT-base random weights, b8 x s128, max |bf16 - fp32| /
        max |fp32| 2.6e-2 with it, 6.0e-3 without (the fp32 stream itself 4.8e-3; docs/cpu-gemm.md#bf16-accuracy)."""
        return torch.float32 if dtype == torch.bfloat16 else dtype

    def precision(self, device):
        """dtype="auto": bf16 where the active tier has native bf16 dot products (`isa.native_bf16`), else
        fp32, with bf16 marked slower on BF16_SLOWER_TIERS."""
        if isa.native_bf16():
            return Precision(torch.bfloat16)
        return Precision(torch.float32, (torch.bfloat16,) if isa.active_cap() in BF16_SLOWER_TIERS else ())

    # --- ops (shapes in bertfast.reference) ---
    def linear(self, x, weight, bias, act: str = "none", residual=None, gated: bool = False, addend=None,
               float_out: bool = False):
        """act(x @ weight.T + bias + addend) + residual. x: (M, K); weight: (N, K), PackedLinear or QuantLinear
        (int8 GEMM, fp32 x); bias: (N,) or None; addend: the rows' LoRA terms (`lora`) or None, computed in the
        GEMM's epilogue before the activation (a row's bits still depend on that row alone); float_out: an fp32
        output from a bf16 weight (`linear.linear`: the heads of a bf16 engine, `head_linear`).

        gated: weight (2N, K) rows [a; b], bias (2N,) or None -> act(x @ a.T + bias_a) * (x @ b.T + bias_b), (M, N):
        the GEMM as for any linear (no activation), then the native gate (`_C.glu`)."""
        if gated:
            activation.check(act, activation.GATED_IDS)
            if residual is not None:
                raise ValueError("a gated linear takes no residual")
            if weight.shape[0] % 2:
                raise ValueError(f"a gated linear needs a weight of 2N rows [a; b], got {tuple(weight.shape)}")
            return _C.glu(self.linear(x, weight, bias, addend=addend), act)
        if isinstance(weight, quant.QuantLinear):
            return quant.linear(x, weight, bias, act, residual, addend)
        return linear.linear(x, weight, bias, act, residual, addend, float_out=float_out)

    def pack(self, weight):
        return linear.PackedLinear(weight.contiguous())

    def pack_lora(self, A, B, segments: int, layer: bool = True):
        """An adapter slot's factors (`lora.Factors`). A bf16 or int8 engine on an AMX tier (`lora.use_tiles`) keeps
        A^T in the shrink's tile form, and B in the expand's where the slot's GEMM runs on the tiles (bf16 with K %
        32 == 0; a layer's int8 GEMM with K % 64 == 0: an int8 engine's pooler and projection are fp32)."""
        int8 = self.quantize == "int8"
        tiles = (int8 or getattr(self, "_dtype", None) == torch.bfloat16) and lora.use_tiles()
        on_tiles = tiles and (A.shape[1] % 64 == 0 and layer if int8 else A.shape[1] % 32 == 0)
        return lora.pack_factors(A, B, segments, tiles=tiles, expand=on_tiles)

    def lora(self, x, index, factors, groups):
        """A `_C.LoraTerm`: the rows' shrunk values now (`_C.lora_shrink`), their products with B in the epilogue
        of the GEMM it is handed to (csrc/cpu/gemm/lora.h)."""
        return lora.term(x, index, factors)

    def sparse_pool(self, x, weight, bias, cu_seqlens, pooling: str = "max", activation: str = "relu"):
        """The native kernel (`_C.sparse_pool`, csrc/cpu/gemm/sparse_pool*.cpp): the pooling in the vocabulary GEMM's
        epilogue, batch-invariant bit for bit. The weight fp32 or bf16 (bf16: on AMX tiles where the tier has them);
        x fp32 or bf16, taken in the weight's dtype (rounded once, as x.to(torch.bfloat16)); bias fp32."""
        if weight.dtype not in self.dtypes or x.dtype not in self.dtypes:
            raise ValueError(f"the cpu backend's sparse_pool runs in float32 or bfloat16, got x {x.dtype}, weight "
                             f"{weight.dtype}")
        w = linear.packed(weight)
        bias = None if bias is None else bias.float()
        return _C.sparse_pool(x.to(w.dtype).contiguous(), w.packed, w.out_features, bias, cu_seqlens, pooling,
                              activation)

    def embeddings(self, input_ids, position_ids, token_type_ids, emb, eps):
        if emb.token_type is None:
            token_type_ids = None
        elif token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        table = emb.token_type if token_type_ids is not None else None
        positions = position_ids if emb.position is not None else None  # rotary models: no position table
        return _C.embeddings(input_ids, positions, token_type_ids, emb.word, emb.position, table,
                        emb.ln_weight, emb.ln_bias, eps)

    def qkv(self, x, weight, bias, num_heads, rotary: Rotary | None = None, addend=None):
        """Returns q, k, v: (T, heads, d) strided views of one (T, 3H) GEMM output (addend (T, 3H) float32 or None
        added in its epilogue); with a `Rotary`, q and k rotated in place in that output (`_C.rotary_`) before they
        are returned."""
        out = self.linear(x, weight, bias, addend=addend)
        if not out.is_contiguous():
            out = out.contiguous()
        T, d = out.shape[0], out.shape[1] // (3 * num_heads)
        if rotary is not None:
            _C.rotary_(out[:, : 2 * num_heads * d].view(T, 2 * num_heads, d), rotary.cos, rotary.sin)
        qkv = out.view(T, 3, num_heads, d)
        return qkv[:, 0], qkv[:, 1], qkv[:, 2]

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale, bias=None, window: int = 0):
        # Under int8 the products run on bf16 operands where AMX is present (docs/int8.md#what-stays-fp32), with a
        # position bias (MPNet, DeBERTa-v2) or a window too (csrc/cpu/attention/attention.cpp).
        return _C.attention(q, k, v, cu_seqlens, int(max_seqlen), float(scale),
                            bf16_products=self.quantize == "int8", window=int(window), **_bias_args(bias))

    def layernorm(self, x, weight, bias, eps):
        return _C.layernorm(x.contiguous(), weight, bias, eps)

    def disentangled(self, q, k, pos_key, pos_query, scale, windows):
        """DeBERTa-v2's c2p / p2c tables (`_C.position_scores`, one dot product per entry, whatever T), each token's
        entries only where its own sequence reads them (windows: `disentangled.token_windows`)."""
        c2p_win, p2c_win = windows
        c2p = None if pos_key is None else _C.position_scores(q, pos_key.contiguous(), float(scale), c2p_win)
        p2c = None if pos_query is None else _C.position_scores(k, pos_query.contiguous(), float(scale), p2c_win)
        return c2p, p2c

    def _whole_layer(self, layer, cfg):
        gemms = [layer.qkv_weight, layer.attn_out_weight, layer.ffn_in_weight, layer.ffn_out_weight]
        int8 = {}
        if self.quantize == "int8":
            int8 = dict(int8_scales=[g.scale for g in gemms], int8_colsums=[g.colsum for g in gemms])
        weights = _C.LayerWeights(
            qkv=gemms[0].packed, qkv_bias=layer.qkv_bias, attn_out=gemms[1].packed, attn_out_bias=layer.attn_out_bias,
            attn_ln_weight=layer.attn_ln_weight, attn_ln_bias=layer.attn_ln_bias, ffn_in=gemms[2].packed,
            ffn_in_bias=layer.ffn_in_bias, ffn_out=gemms[3].packed, ffn_out_bias=layer.ffn_out_bias,
            ffn_ln_weight=layer.ffn_ln_weight, ffn_ln_bias=layer.ffn_ln_bias, **int8)
        return _C.Layer(weights, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                        cfg.layer_norm_eps, cfg.activation)

    def whole_layer(self, x, layer, lora=None):
        """`_C.Layer` for a layer it can run (bit-identical to the ops composed one by one), else None; lora: the
        layer's `adapters_rows.LayerAdapters`, each GEMM's terms computed inside the layer as `linear` adds them
        (`lora.LayerSlots`)."""
        whole = getattr(self, "_whole", {}).get(id(layer))
        if whole is None or not x.is_contiguous():
            return None
        slots = {} if lora is None else dict(zip(("lora", "lora_index"), self._layer_slots(lora)))
        return lambda x, cu_seqlens, max_seqlen, scale, bias, carry=None: whole(
            x, cu_seqlens, max_seqlen, scale, carry=carry, **slots, **_bias_args(bias))

    def _layer_slots(self, lora):
        """The forward's (slots, index) (`LayerSlots`) of its layer `lora.layer`, for all its layers at the first:
        built between the layers' GEMMs, on cold caches, each took about four times as long."""
        rows = lora.rows
        if "cpu layer slots" not in rows.memo:
            if getattr(self, "_slots", None) is None:
                self._slots = LayerSlots()
            rows.memo["cpu layer slots"] = self._slots(rows)
        return rows.memo["cpu layer slots"][lora.layer]

    def layer_carry(self):
        """An int8 model's `_C.LayerCarry`: each native layer quantizes its output for the next one's QKV GEMM as it
        normalizes it (csrc/bindings/layer.h), the same codes the next would compute."""
        return _C.LayerCarry() if self.quantize == "int8" and getattr(self, "_whole", None) else None


def _fits_whole_layer(layer: LayerWeights, cfg) -> bool:
    """Whether `_C.Layer` can run `layer`: a post-LayerNorm BERT layer with every bias, a plain (ungated) FFN
    of cfg.intermediate_size and an activation of the layer table. (Rotary and windowed layers never reach
    `whole_layer`: the engine composes them from the ops.)"""
    tensors = (layer.qkv_bias, layer.attn_out_bias, layer.attn_ln_weight, layer.attn_ln_bias, layer.ffn_in_bias,
               layer.ffn_out_bias, layer.ffn_ln_weight, layer.ffn_ln_bias)
    return (all(t is not None for t in tensors) and layer.ffn_in_weight.shape[0] == cfg.intermediate_size
            and cfg.activation in activation.LAYER_IDS)


def _bias_args(bias) -> dict:
    """The native calls' keyword arguments for an AttentionBias or a DisentangledBias (none without one)."""
    if isinstance(bias, DisentangledBias):
        return dict(c2p=bias.c2p, p2c=bias.p2c, rel_index=bias.index, bias_positions=bias.positions)
    return {} if bias is None else dict(bias_table=bias.table, bias_positions=bias.positions)
