"""The "cpu" backend: native kernels from `bertfast._C` (csrc/) on the packed [T, H] token layout.

Embedding + LayerNorm, varlen attention (reading q/k/v in place from the fused QKV output) and
LayerNorm run in C++ (OpenMP, code per ISA tier chosen at run time, bertfast.isa). GEMMs run on the
extension's own kernel on weights prepacked at load, with bias, GELU and residual fused into its
epilogue, up to `native_rows(dtype)` tokens (the routing rule, per tier). Larger GEMMs go to torch
(prepacked oneDNN for bf16 with native bf16 dot products, residual add fused; MKL sgemm for fp32 below
AVX-512) followed by an in-place activation. Both forms of every weight are made
once, in `prepare`. A layer whose GEMMs all run on the extension runs whole in C++ (`_C.Layer`,
csrc/cpu/layer.cpp), the same kernels in the same order as op by op, without the Python between them.
fp32 and bf16; fp16 raises ValueError (this CPU path has no fast fp16 GEMM). With quantize="int8"
(`dtype="int8"` at load) the four per-layer GEMMs run int8 (`bertfast.quant.QuantLinear`: weights per
channel, activations per token) and attention's two products bf16 (AMX); everything else, the pooler
included, stays fp32.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from .. import isa, quant
from ..loading import LayerWeights, ModelWeights
from .base import Backend, Precision

try:
    from .. import _C
except ImportError as e:  # not built (BERTFAST_NO_EXT=1, or a source checkout without build_ext)
    _C = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = None


class PackedLinear:
    """One linear layer in the forms the cpu backend runs it.

    weight: (N, K) as loaded; weight_t: its (K, N) transpose view for torch's fp32 GEMM (MKL, large M);
    onednn: bf16 only, the weight reordered once into oneDNN's blocked layout (AMX), or None;
    packed: the extension's panel layout for its GEMM (`_C.pack_linear`).
    """

    __slots__ = ("weight", "weight_t", "onednn", "packed", "out_features", "in_features")

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be (out_features, in_features), got {tuple(weight.shape)}")
        self.weight = weight.contiguous()
        self.weight_t = self.weight.t()
        self.onednn = _onednn_weight(self.weight) if isa.native_bf16() else None
        self.packed = _C.pack_linear(self.weight)
        self.out_features, self.in_features = self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def shape(self):
        return self.weight.shape


# oneDNN's prepacked linear (what inductor's freezing uses): a bf16 GEMM on a weight reordered once runs
# ~25% faster than F.linear, which reorders the weight on every call, and fuses the residual add into
# the GEMM. fp32 stays on MKL's sgemm, which oneDNN does not beat here. The activation after a large
# GEMM is torch's in-place one: measured on Sapphire Rapids (1024 x 3072, 2 threads), oneDNN's fused
# erf-GELU post-op costs ~5 ms, the extension's bias_act_ ~2.5 ms, torch's gelu_ ~1.3-2 ms.
_ACTIVATE = {
    "none": lambda t: t,
    "gelu": lambda t: torch.ops.aten.gelu_(t),
    "gelu_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh"),
    "relu": torch.relu_,
    "tanh": torch.tanh_,
}
_ONEDNN_BATCH_HINT = 1024  # the M the blocked layout is tuned for; any M runs correctly


def _onednn_weight(weight: torch.Tensor):
    if weight.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: F.linear is used instead
        return None


# oneDNN's bf16 GEMM slows down sharply past a few hundred rows when the output is no wider than the
# input and the weight is BERT-base-sized (Sapphire Rapids, 2 threads, median of 20): (1024 x 3072) @
# (3072 x 768) + residual 4.3-7.3 ms in one call, 2.5-4.4 ms as three calls of <= 384 rows (copy
# included); (1024 x 768) @ (768 x 768) + residual 1.04-1.44 vs 0.70-1.27 ms. Wider outputs (QKV, FFN
# in) are even or lose to the copy (FFN in + GELU: 2.4 ms in one call, 3.0 in blocks), and so do small
# weights (MiniLM, 384 wide: (1024 x 1536) @ (1536 x 384) + residual 0.85 ms in one call, 2.1 in
# blocks). So only outputs of 768 to in_features columns run in row blocks.
_ONEDNN_MAX_ROWS = 384
_ONEDNN_BLOCK_MIN_OUT = 768


def _onednn_linear(x, weight, out_features, bias, residual):
    """x @ W.T + bias (+ residual) on a oneDNN-prepacked bf16 weight (row blocks where faster)."""
    def block(lo, hi):
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x[lo:hi], weight, bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x[lo:hi], residual[lo:hi], weight, bias, "add")

    M = x.shape[0]
    if M <= _ONEDNN_MAX_ROWS or not _ONEDNN_BLOCK_MIN_OUT <= out_features <= x.shape[1]:
        return block(0, M)
    step = -(-M // -(-M // _ONEDNN_MAX_ROWS))  # equal blocks of at most _ONEDNN_MAX_ROWS rows
    return torch.cat([block(lo, min(M, lo + step)) for lo in range(0, M, step)])


def _packed(weight) -> PackedLinear:
    # Ops also accept plain weights (packed on the fly) so op-level tests need no `prepare`.
    return weight if isinstance(weight, PackedLinear) else PackedLinear(weight)


# Tiers without native bf16 dot products where the cpu backend's bf16 forward measured slower than its
# fp32 one (`precision`; README "CPU ISA tiers" has the runs): portable, 1.06x fp32's time at BERT-base
# b8 x s128 (both on MKL's SSE2 sgemm past 256 tokens, bf16 widened). avx2 0.72 / 0.98 at b1 x s16 /
# b8 x s128. avx512_vnni without AVX-512 BF16 (Intel before Cooper Lake) is unmeasured.
BF16_SLOWER_TIERS: tuple[str, ...] = ("portable",)


class CpuBackend(Backend):
    name = "cpu"
    dtypes = (torch.float32, torch.bfloat16)
    quantizations = ("int8",)

    @classmethod
    def unavailable_reason(cls, device):
        if device != "cpu":
            return f"the cpu backend runs on CPU tensors only, not on device {device!r}"
        if _C is None:
            return f"native extension not built: run bash install.sh ({_IMPORT_ERROR})"
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
        contiguous = weights.map(lambda t: t.contiguous())
        pack = quant.QuantLinear.from_float if self.quantize == "int8" else PackedLinear
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
        pooler = None if contiguous.pooler_weight is None else PackedLinear(contiguous.pooler_weight)
        # Each distinct layer also as one C++ object running it whole on the extension's GEMMs.
        self._whole = {id(layer): self._whole_layer(layer, weights.config) for layer in seen.values()}
        return dataclasses.replace(contiguous, layers=layers, pooler_weight=pooler)

    def precision(self, device):
        """dtype="auto": bf16 where the active tier has native bf16 dot products (`isa.native_bf16`), else
        fp32; bf16 is marked slower than fp32 on the tiers where it measured so (BF16_SLOWER_TIERS).

        Measured (bf16 / fp32 forward time, BERT-base b1 x s16 and b8 x s128, 2 threads, AMD EPYC Zen 4;
        README "CPU ISA tiers"): avx512_vnni with AVX-512 BF16 0.54 / 0.55. Without native dot products the
        extension widens bf16 weights to fp32 on the fly: half the weight traffic at a few tokens, the same
        arithmetic at many (avx2 cap 0.70 / 0.98), so fp32, exact to 1e-5, is as fast where it counts."""
        if isa.native_bf16():
            return Precision(torch.bfloat16)
        return Precision(torch.float32, (torch.bfloat16,) if _C.isa() in BF16_SLOWER_TIERS else ())

    def native_rows(self, dtype) -> int:
        """The GEMM routing rule: the largest token count whose fp32/bf16 GEMMs run on the extension's
        own kernel (`_C.linear`) on the active ISA tier; above it torch's GEMM (MKL fp32, oneDNN bf16).
        (int8: `quant.native_rows`.)"""
        tier = _C.isa()
        if dtype == torch.float32:
            # AVX-512: the blocked regime took 0.95-0.97x the time of MKL's sgemm at 576 rows (BERT-base,
            # Sapphire Rapids, 2 threads) and fuses bias, GELU and residual. Below it, MKL past 256 rows.
            return sys.maxsize if tier in ("avx512_vnni", "amx") else 256
        if isa.native_bf16():
            return 64  # bf16 dot products in oneDNN's prepacked GEMM beat ours past 64 rows
        # Without them oneDNN's bf16 GEMM is an emulation: 2.8x (avx512_vnni cap) to 4x (avx2 cap) the time
        # of fp32 at BERT-base b8 x s128 (AMD EPYC). Ours widens bf16 weights on the fly at any M, except
        # on the portable tier, whose plain loops past 256 rows lose to torch's fp32 GEMM on widened operands.
        return 256 if tier == "portable" else sys.maxsize

    # --- the one GEMM entry point ---
    def linear(self, x, weight, bias, act: str = "none", residual=None):
        """act(x @ weight.T + bias) + residual. x: (M, K); weight: (N, K), PackedLinear or QuantLinear
        (int8 GEMM, fp32 x); bias: (N,)."""
        if isinstance(weight, quant.QuantLinear):
            return quant.linear(x, weight, bias, act, residual)
        w = _packed(weight)
        if x.dim() != 2 or x.shape[1] != w.in_features:
            raise ValueError(f"x must be (M, {w.in_features}), got {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the weight has {w.dtype}")
        if act not in _ACTIVATE:
            raise ValueError(f"unknown activation {act!r} (expected one of {', '.join(_ACTIVATE)})")
        if x.shape[0] <= self.native_rows(x.dtype):
            return _C.linear(x, w.packed, w.out_features, bias, act, residual)
        if x.stride(1) != 1:
            x = x.contiguous()
        if residual is not None and act != "none":
            raise ValueError("an activation and a residual together are not supported")
        if w.onednn is not None and isa.native_bf16():
            return _ACTIVATE[act](_onednn_linear(x, w.onednn, w.out_features, bias, residual))
        # fp32 GEMM (MKL); bf16 without native bf16 dot products on widened operands
        wide = x.dtype != torch.float32
        xf, wf = (x.float(), w.weight_t.float()) if wide else (x, w.weight_t)
        out = torch.addmm(bias.to(xf.dtype), xf, wf) if bias is not None else torch.mm(xf, wf)
        if residual is not None:
            out += residual
        out = _ACTIVATE[act](out)
        return out.to(x.dtype) if wide else out

    # --- ops (shapes in bertfast.reference) ---
    def embed(self, input_ids, position_ids, token_type_ids, emb, eps):
        if emb.token_type is None:
            token_type_ids = None
        elif token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        table = emb.token_type if token_type_ids is not None else None
        return _C.embed(input_ids, position_ids, token_type_ids, emb.word, emb.position, table,
                        emb.ln_weight, emb.ln_bias, eps)

    def qkv(self, x, weight, bias, num_heads):
        """Returns q, k, v: (T, heads, d) strided views of one (T, 3H) GEMM output."""
        out = self.linear(x, weight, bias)
        qkv = out.view(out.shape[0], 3, num_heads, -1)
        return qkv[:, 0], qkv[:, 1], qkv[:, 2]

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale):
        # Under int8 the products run on bf16 operands where AMX is present (see bertfast.quant).
        return _C.attention(q, k, v, cu_seqlens, int(max_seqlen), float(scale),
                            bf16_products=self.quantize == "int8")

    def linear_residual(self, x, weight, bias, residual):
        return self.linear(x, weight, bias, "none", residual)

    def _whole_layer(self, layer, cfg):
        gemms = [layer.qkv_weight, layer.attn_out_weight, layer.ffn_in_weight, layer.ffn_out_weight]
        int8 = {}
        if self.quantize == "int8":
            if any(g.packed is None for g in gemms):  # an extension without the int8 small-M kernel
                return None
            int8 = dict(int8_scales=[g.scale for g in gemms], int8_colsums=[g.colsum for g in gemms])
        weights = _C.LayerWeights(
            qkv=gemms[0].packed, qkv_bias=layer.qkv_bias, attn_out=gemms[1].packed, attn_out_bias=layer.attn_out_bias,
            attn_ln_weight=layer.attn_ln_weight, attn_ln_bias=layer.attn_ln_bias, ffn_in=gemms[2].packed,
            ffn_in_bias=layer.ffn_in_bias, ffn_out=gemms[3].packed, ffn_out_bias=layer.ffn_out_bias,
            ffn_ln_weight=layer.ffn_ln_weight, ffn_ln_bias=layer.ffn_ln_bias, **int8)
        return _C.Layer(weights, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                        cfg.layer_norm_eps, cfg.activation)

    def layer(self, x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act):
        """A layer whose GEMMs all run on the extension's kernel runs whole in C++ (`_C.Layer`: the same
        kernels in the same order, bit-identical, without the Python between them); others op by op."""
        whole = getattr(self, "_whole", {}).get(id(layer))
        native = quant.native_rows() if self.quantize == "int8" else self.native_rows(x.dtype)
        if whole is not None and x.shape[0] <= native and x.is_contiguous():
            return whole(x, cu_seqlens, int(max_seqlen), float(scale))
        return super().layer(x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act)

    def layernorm(self, x, weight, bias, eps, residual=None):
        return _C.layernorm(x.contiguous(), weight, bias, eps,
                            residual.contiguous() if residual is not None else None)

    def linear_gelu(self, x, weight, bias, act="gelu"):
        return self.linear(x, weight, bias, act)

    def pooler(self, cls_hidden, weight, bias):
        return self.linear(cls_hidden.contiguous(), weight, bias, "tanh")
