"""The backend contract: what the engine calls, and nothing else.

`prepare` runs once at load and may replace weight tensors by the backend's packed forms (the ops then
receive those forms). The ops work on the packed token layout: activations are (T, features) with T the
real tokens of all sequences, sequences delimited by `cu_seqlens` (B+1,) int32. The engine composes a
layer from `qkv`, `attention`, `linear` and `layernorm` (`engine.compose_layer`) unless `whole_layer`
hands it a callable that runs the layer in one piece (the cpu backend's C++ `Layer`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .weights import LayerWeights, ModelWeights


# Tokens of logits the default `sparse_pool` holds at once (memory: SPARSE_BLOCK x vocab).
SPARSE_BLOCK = 128


class BackendUnavailable(RuntimeError):
    """A backend's module cannot be imported here (missing dependency or extension)."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """What a backend's measurements say about its float dtypes on one device (`Backend.precision`).

    auto: the dtype `dtype="auto"` loads, the fastest one within the fidelity rule (fp32 or bf16; int8
    only when asked for by name). slower: dtypes measured slower than fp32 there; asking for one by name
    warns once per process."""

    auto: torch.dtype
    slower: tuple[torch.dtype, ...] = ()


def cuda_precision() -> Precision:
    """dtype="auto" on CUDA: bf16 where the GPU has it, else fp32."""
    return Precision(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)


class AttentionBias(NamedTuple):
    """An additive relative position bias (MPNet), the same for every layer of one forward: score(t, u) +=
    table[h, (width - 1) / 2 + positions[u] - positions[t]] for tokens t, u of one sequence.

    table: (heads, width) float32, width odd, one value per head and distance; positions: (T,) int32."""

    table: torch.Tensor
    positions: torch.Tensor


class DisentangledBias(NamedTuple):
    """DeBERTa-v2's disentangled attention terms of one layer (`bertfast.disentangled`): for tokens t (query) and
    u (key) of one sequence, c = index[(width - 1) / 2 + positions[t] - positions[u]] and
    score(t, u) += c2p[t, h, c] + p2c[u, h, c], the terms already scaled as q.k is.

    c2p, p2c: (T, heads, R) float32 contiguous, or None where the model lacks that term; index: (width,) int32,
    width odd, values in [0, R); positions: (T,) int32 (each token's column in the padded batch)."""

    c2p: torch.Tensor | None
    p2c: torch.Tensor | None
    index: torch.Tensor
    positions: torch.Tensor


class Rotary(NamedTuple):
    """Rotary position embeddings (RoPE) for q and k, the half-split ("rotate_half") convention over the whole
    head dim d: for i < d/2, y[i] = x[i] cos[t, i] - x[i + d/2] sin[t, i] and y[i + d/2] = x[i + d/2] cos[t, i] +
    x[i] sin[t, i], computed in fp32 and rounded once to x's dtype. One table per forward (ModernBERT: one per
    theta), from each token's position id (`engine.rotary_tables`).

    cos, sin: (T, d/2) float32."""

    cos: torch.Tensor
    sin: torch.Tensor


class Tokens(NamedTuple):
    """The packed inputs of one forward after unpad: everything the layer stack reads (`Engine.encode`).

    ids, positions: (T,) int64; types: (T,) int64 or None (no token-type table); columns: (T,) int32, each
    token's column in the padded batch, or None (only MPNet's relative bias reads it); cu_seqlens: (B+1,)
    int32; max_seqlen: int >= every sequence's length; width: the padded batch's S (the bias table's span)."""

    ids: torch.Tensor
    positions: torch.Tensor
    types: torch.Tensor | None
    columns: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    width: int


class Backend:
    name = "base"
    # Families this backend cannot run yet: model_type -> why. backend="auto" passes over such a backend.
    unsupported_families: dict[str, str] = {}
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    quantizations: tuple[str, ...] = ()  # weight quantization schemes `prepare` can apply, e.g. "int8"
    # The vocabulary weights `sparse_pool` takes in their own dtype; any other is packed fp32 once, at load.
    sparse_pool_dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    # Why LoRA adapters (the `addend` of `linear` and `qkv`) do not run on this backend, or None where they do.
    no_adapters: str | None = None

    def __init__(self, quantize: str | None = None):
        if quantize is not None and quantize not in self.quantizations:
            offered = ", ".join(self.quantizations) or "none"
            raise ValueError(f"backend {self.name!r} does not support {quantize!r} quantization "
                             f"(it offers: {offered})")
        self.quantize = quantize

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        """None if the backend runs on this device type, else why not."""
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            raise ValueError(f"backend {self.name!r} does not support dtype {dtype}; it supports {names}")

    def precision(self, device: str) -> Precision:
        """dtype="auto" and the dtypes measured slower than fp32 on device type `device` ("cpu", "cuda"): each
        backend's own rule (on CUDA, `cuda_precision`)."""
        raise NotImplementedError

    def stream_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The residual stream's dtype in a forward on weights of `dtype`: the layers' inputs and outputs, the sums
        of residual adds and the LayerNorms. Default: `dtype` itself; the cpu backend keeps it fp32 under bf16, its
        GEMMs' operands bf16 (`linear` then takes fp32 x and residuals)."""
        return dtype

    def graph_unavailable_reason(self, device: torch.device) -> str | None:
        """None when a forward's launches on `device` can be captured in a CUDA graph (no host syncs, no
        host-side shape logic past the packed sizes), else why not. The engine then replays a graph per
        token-count bucket (`backends.cuda.graphs`). Default: not capturable."""
        return f"backend {self.name!r} does not launch through CUDA graphs"

    def prepare(self, weights: ModelWeights) -> ModelWeights:
        """Pack weights once for this backend (layouts, prepacked GEMM operands). Default: as is."""
        self.check_dtype(weights.dtype)
        return weights

    # --- ops (shapes and the exact math: the same-named functions of bertfast.reference) ---
    def embeddings(self, input_ids, position_ids, token_type_ids, emb, eps):
        """LayerNorm(word[ids] + token_type[types] + position[positions]); ids (T,) int64 -> (T, E). The token
        type table (emb.token_type) and the position table (emb.position: None for rotary models) may be absent;
        emb.ln_bias is always a tensor (zeros where the checkpoint's norm has no bias)."""
        raise NotImplementedError

    def linear(self, x, weight, bias, act: str = "none", residual=None, gated: bool = False, addend=None):
        """act(x @ weight.T + bias + addend) + residual. x: (M, K); weight: (N, K) or this backend's packed form;
        bias: (N,) or None; act: an id of `kernels.activation`; residual: (M, N) or None; addend: the rows' LoRA
        terms as this backend's `lora` gives them ((M, N) float32 by default) or None, added before the activation.

        gated (GLU: GeGLU, SwiGLU): weight (2N, K) and bias (2N,) hold two halves, rows [a; b]; the result is
        act(x @ a.T + bias_a + addend_a) * (x @ b.T + bias_b + addend_b), (M, N), addend (M, 2N); no residual then."""
        raise NotImplementedError

    def qkv(self, x, weight, bias, num_heads, rotary: Rotary | None = None, addend=None):
        """Fused projection: x (T, H), weight (3H, H) -> q, k, v (T, heads, d), views allowed; bias (3H,) or
        None; addend: `lora`'s terms (T, 3H) or None, added to the projection before rotary; with a `Rotary`, q and k
        come out rotated."""
        raise NotImplementedError

    def pack_lora(self, A, B, segments: int, layer: bool = True):
        """One adapter's factors of a slot in the form `lora` takes: A (r, K), B (N, r) float32 on the weights'
        device, the scale folded into B; the slot's N outputs are `segments` equal runs (q | k | v: 3; gate | up: 2),
        each reading only its own modules' rank; layer: the slot is a layer's GEMM (False: the pooler's or the
        embedding projection's). Default: each packed for `linear`."""
        return self.pack(A), self.pack(B)

    def lora(self, x, index, factors, groups):
        """A slot's LoRA terms over a call's rows, the `addend` of `linear` and `qkv`: x (M, K) the slot's input;
        index (M,) int32, each row's position in `factors` or -1; factors: per adapter of the forward its
        `pack_lora` or None; groups: (position, rows) pairs, rows a slice or an index tensor of one adapter's rows.
        A row's term must depend on its own x and factors alone. Default: (M, N) float32, (x A^T) B^T per group
        through `linear`, zeros elsewhere."""
        out = None
        for i, rows in groups:
            if factors[i] is None:
                continue
            A, B = factors[i]
            delta = self.linear(self.linear(x[rows].float(), A, None), B, None)
            if out is None:
                out = torch.zeros(x.shape[0], delta.shape[1], dtype=torch.float32, device=x.device)
            out[rows] = delta
        return out

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale, bias: AttentionBias | None = None,
                  window: int = 0):
        """Varlen softmax attention of each sequence on itself: q, k, v (T, heads, d) -> (T, heads * d);
        softmax(q k^T * scale + bias) v, bias an AttentionBias, a DisentangledBias or None. window > 0 (sliding-window attention,
        ModernBERT's local layers): token t of a sequence attends only to the tokens u of it with
        |t - u| <= window, and the work outside the window is skipped, not masked after computing it."""
        raise NotImplementedError

    def layernorm(self, x, weight, bias, eps):
        raise NotImplementedError

    def disentangled(self, q, k, pos_key, pos_query, scale, windows):
        """DeBERTa-v2's per-token position terms (`reference.disentangled`): q, k (T, heads, d) views allowed;
        pos_key, pos_query (R, heads * d) or None -> (c2p, p2c), (T, heads, R) float32 contiguous or None, with
        c2p[t, h, r] = scale * q[t, h] . pos_key[r, h] and p2c[t, h, r] = scale * k[t, h] . pos_query[r, h]. A
        table entry must not depend on T (batch invariance). windows: (c2p's, p2c's), (T, 2) int32 each, the columns
        [lo, hi) each token's own sequence reads (`disentangled.token_windows`): a backend may leave the entries
        outside them unwritten, or compute every entry."""
        raise NotImplementedError

    def pack(self, weight):
        """A (N, K) weight in the form this backend's `linear` and `sparse_pool` take it, packed once (a head's
        weights; the layers' are packed by `prepare`). Default: as is."""
        return weight

    def sparse_pool(self, x, weight, bias, cu_seqlens, pooling: str = "max", activation: str = "relu"):
        """SPLADE's pooling of the MLM logits (`reference.sparse_pool`): x (T, K); weight (V, K) or `pack`'s form;
        bias (V,) or None; cu_seqlens (B+1,) int32 -> (B, V) float32, per sequence the max or sum over its tokens
        of log1p(relu(x @ weight.T + bias)) (log1p twice for "log1p_relu"), never holding the (T, V) logits.
        Default (the torch and triton backends): torch ops in fp32 on SPARSE_BLOCK tokens of logits at a time."""
        if pooling not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
            raise ValueError(f"pooling must be 'max' or 'sum' and activation 'relu' or 'log1p_relu', "
                             f"got {pooling!r} and {activation!r}")
        x, weight = x.float(), weight.float()
        bias = None if bias is None else bias.float()
        bounds = cu_seqlens.tolist()
        out = x.new_zeros(len(bounds) - 1, weight.shape[0])
        for b, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            for t0 in range(start, end, SPARSE_BLOCK):
                y = torch.nn.functional.linear(x[t0:min(end, t0 + SPARSE_BLOCK)], weight, bias).relu_().log1p_()
                if activation == "log1p_relu":
                    y = y.log1p_()
                out[b] = torch.maximum(out[b], y.amax(0)) if pooling == "max" else out[b] + y.sum(0)
        return out

    def whole_layer(self, x, layer: LayerWeights, lora=None):
        """A callable (x, cu_seqlens, max_seqlen, scale, bias, carry=None) -> x running `layer` on `x` in one piece
        (bias: an AttentionBias or None; carry: `layer_carry`'s), or None for the engine to compose it from the ops
        above (the default). lora: None, or the layer's `adapters_rows.LayerAdapters` (rows' adapters, `compose_layer`'s
        lora): the callable then adds each GEMM's terms as the composed layer hands them to the ops, the same bits;
        a backend whose whole layer cannot returns None for it."""
        return None

    def layer_carry(self):
        """What the engine hands each whole layer of one forward in turn, for a layer to leave the next what it
        computed of its input (the cpu backend's int8 layers: their output's codes), or None (the default)."""
        return None
