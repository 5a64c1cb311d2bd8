"""The "triton" backend: every op is a Triton kernel from `bertfast.kernels.triton`.

On CUDA this is the fast path. On CPU it runs under the Triton interpreter, which must be switched
on with TRITON_INTERPRET=1 before `bertfast.kernels.triton` is imported; that mode is for validation (slow,
and fp32/fp16 only: the interpreter cannot compute in bf16).
"""

from __future__ import annotations

import os
import weakref

import torch

from ...kernels import activation
from . import gemm_choice
from ..contract import Backend, Precision, cuda_precision


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    return None


class TritonBackend(Backend):
    name = "triton"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # tl.dot has no fp64 path worth having
    # "fp8": the layers' four GEMMs on e4m3 codes (sm_89+; `kernels.triton.fp8`), everything else fp16.
    quantizations = ("fp8",)
    FP8_GEMMS = ("qkv_weight", "attn_out_weight", "ffn_in_weight", "ffn_out_weight")
    _fp8 = None  # the fp8 kernels' module once `prepare` has quantized the weights

    @classmethod
    def unavailable_reason(cls, device):
        reason = _triton_import_error()
        if reason is not None:
            return reason
        if device == "cuda":
            return None
        if device == "cpu":
            if os.environ.get("TRITON_INTERPRET", "0") != "1":
                return ("on CPU the triton backend runs only under the Triton interpreter: "
                        "set TRITON_INTERPRET=1 before importing bertfast")
            import sys

            ops = sys.modules.get("bertfast.kernels.triton")
            if ops is not None and not ops.INTERPRET:
                return ("bertfast.kernels.triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                        "were built for GPU; set the variable before the first import")
            return None
        return f"device type {device!r} is not supported (cuda, or cpu under TRITON_INTERPRET=1)"

    def __init__(self, quantize=None):
        super().__init__(quantize)
        from ...kernels import triton as ops

        self._ops = ops
        self._gemm = gemm_choice.GemmChoices([], None)  # read from the table in `prepare`, for the weights' GPU
        self._lora_tables = _LoraTables(ops.lora)

    def precision(self, device):
        # The interpreter (CPU) computes no bf16: fp32 there; on CUDA bf16 where supported.
        return Precision(torch.float32) if device == "cpu" else cuda_precision()

    def graph_unavailable_reason(self, device):
        # Every launcher is free of device-to-host reads once the engine passes validate/check_ids=False.
        if torch.device(device).type != "cuda":
            return "CUDA graphs need a CUDA device (on CPU the kernels run in the Triton interpreter)"
        return None

    def prepare(self, weights):
        self.check_dtype(weights.dtype)
        if weights.device.type == "cpu" and weights.dtype not in self._ops.INTERPRETER_DTYPES:
            raise ValueError(f"backend 'triton' on CPU (Triton interpreter) supports float32 and float16, "
                             f"not {weights.dtype}; load with dtype='fp16' or 'fp32', or run on CUDA")
        self._gemm = gemm_choice.for_device(weights.device)
        if self.quantize == "fp8":  # the four GEMM weights per output channel; no whole-layer kernel then
            import dataclasses

            from ...kernels.triton import fp8

            cfg = weights.config
            if weights.dtype != torch.float16:
                raise ValueError(f"fp8 quantization starts from float16 weights (dtype='fp8' loads them so), got "
                                 f"{weights.dtype}")
            if cfg.rotary or cfg.gated_ffn:
                raise ValueError(f"dtype='fp8' on backend 'triton' runs layers with a plain QKV projection and an "
                                 f"ungated FFN; {cfg.family} has {'rotary embeddings' if cfg.rotary else 'a gated FFN'}"
                                 ": load it with dtype='fp16'")
            fp8.check_arch(weights.device)
            self._fp8 = fp8
            seen = {}  # shared layers (ALBERT) stay shared
            for layer in weights.layers:
                if id(layer) not in seen:
                    seen[id(layer)] = dataclasses.replace(
                        layer, **{name: fp8.quantize_weight(getattr(layer, name)) for name in self.FP8_GEMMS})
            return dataclasses.replace(weights, layers=[seen[id(layer)] for layer in weights.layers])
        self._device = weights.device
        self._whole = self._whole_layer_shape(weights)
        return weights

    def _whole_layer_shape(self, weights):
        """(heads, eps, act, layers) where every layer may run as one persistent kernel (`kernels.triton.layer`):
        post-LayerNorm BERT layers with every bias, a plain FFN and no position bias, with no GEMM routed to cuBLAS
        (the kernel matches the Triton kernels' bits, not cuBLAS's); else None. Each call's own shape is `whole_layer`'s
        to judge (`layer.fits`)."""
        cfg = weights.config
        if (cfg.norm_first or cfg.rotary or cfg.gated_ffn or cfg.disentangled or bool(self._gemm)
                or weights.embeddings.relative_bias is not None or cfg.activation not in activation.LAYER_IDS):
            return None
        for layer in weights.layers:
            if any(t is None for t in (layer.qkv_bias, layer.attn_out_bias, layer.attn_ln_weight, layer.ffn_in_bias,
                                       layer.ffn_out_bias, layer.ffn_ln_weight)):
                return None
        return cfg.num_attention_heads, cfg.layer_norm_eps, cfg.activation, len(weights.layers)

    def whole_layer(self, x, layer, lora=None):
        """The persistent one-launch layer for a call of at most `layer.MAX_TOKENS` tokens (the same bits as the ops
        composed, so the token count that picks it never changes a row), else None; None with LoRA adapters too (its
        kernel takes no addend: the engine composes those layers)."""
        shape = getattr(self, "_whole", None)
        if shape is None or lora is not None or not self._ops.layer.fits(x.shape[0], x.shape[1], shape[0], x.dtype) \
                or not x.is_contiguous():
            return None
        heads, eps, act, _ = shape

        def run(x, cu_seqlens, max_seqlen, scale, bias, carry=None):
            work = carry.next() if carry is not None else torch.zeros(1 + self._ops.layer.PHASES, dtype=torch.int32,
                                                                      device=x.device)
            return self._ops.layer.bert_layer(x, layer, cu_seqlens, max_seqlen, heads, scale, eps, act, work)

        return run

    def layer_carry(self):
        """The work counters of a forward's persistent layers, zeroed once for all of them (one memset, not one per
        layer), or None where no layer runs whole."""
        shape = getattr(self, "_whole", None)
        return None if shape is None else _WorkCounters(shape[3], self._ops.layer.PHASES, self._device)

    def _cublas(self, op, x, weight) -> bool:
        """The one GEMM routing rule of this backend: cuBLAS where the measured table says so for this shape on this
        GPU (`backends.cuda.gemm_choice`), else the fused Triton kernel."""
        return bool(self._gemm) and self._gemm.cublas(op, x.shape[0], weight.shape[0], weight.shape[1], x.dtype)

    # The engine hands over cu_seqlens from `padding.unpad` and ids that `inputs.check_inputs`
    # validated, so the launchers skip their device-to-host value checks (validate/check_ids=False).
    def embeddings(self, input_ids, position_ids, token_type_ids, emb, eps):
        return self._ops.embedding.embeddings(input_ids, position_ids, token_type_ids, emb, eps, check_ids=False)

    @property
    def no_adapters(self):
        """LoRA deltas join the Triton kernels' epilogue (`addend`); the fp8 GEMMs take none."""
        if self.quantize == "fp8":
            return "adapters on the triton backend under fp8: not yet (the e4m3 GEMMs' epilogue takes no LoRA delta)"
        return None

    def pack_lora(self, A, B, segments, layer=True):
        """A^T and B^T float32, the rank padded to 16 (`kernels.triton.lora.Factors`); the q | k | v runs' zero
        blocks of B are kept (they add exact zeros)."""
        return self._ops.lora.pack_factors(A, B)

    def lora(self, x, index, factors, groups):
        """(T, N) float32: the rows' terms from the segmented shrink and expand kernels (`kernels.triton.lora`), two
        launches for any number of adapters; the tile and pointer tables are built once per forward and adapter set."""
        N = next((f.bt.shape[1] for f in factors if f is not None), None)
        if N is None:  # no adapter of the forward has the slot
            return None
        return self._ops.lora.lora_terms(x, self._lora_tables.tiles(groups, x.shape[0], x.device),
                                         self._lora_tables.pointers(factors, x.device), factors, N)

    def qkv(self, x, weight, bias, num_heads, rotary=None, addend=None):
        if addend is not None:  # the Triton kernel, whose epilogue adds it (cuBLAS and the TMA GEMM take none)
            if self._fp8 is not None and isinstance(weight, self._fp8.Fp8Weight):
                raise NotImplementedError(self.no_adapters)
            return self._ops.qkv.qkv(x, weight, bias, num_heads, rotary=rotary, addend=addend)
        if self._fp8 is not None and isinstance(weight, self._fp8.Fp8Weight):  # rotary refused in `prepare`
            return self._fp8.qkv(x, weight, bias, num_heads)
        # RoPE is the QKV GEMM's epilogue (q and k rotated before they are stored).
        tile = self._gemm.tma("qkv", *weight.shape, x.dtype) if rotary is None else None
        if tile is not None:
            return gemm_choice.tma_qkv(x, weight, bias, num_heads, tile)
        if rotary is None and self._cublas("qkv", x, weight):
            return gemm_choice.cublas_qkv(x, weight, bias, num_heads)
        return self._ops.qkv.qkv(x, weight, bias, num_heads, rotary=rotary)

    def disentangled(self, q, k, pos_key, pos_query, scale, windows):
        """DeBERTa-v2's c2p / p2c tables, one fixed-tile kernel each: a token's entries the same bits in any batch
        (every entry, windows or not)."""
        def table(x, pos):
            return None if pos is None else self._ops.disentangled.position_scores(x, pos, scale)

        return table(q, pos_key), table(k, pos_query)

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale, bias=None, window=0):
        # bias: MPNet's AttentionBias (per-distance table, per-token positions) or DeBERTa-v2's DisentangledBias
        # (per-token c2p / p2c tables, per-distance index), gathered per score tile.
        return self._ops.attention.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, validate=False,
                                                    window=window, bias=bias)

    def linear(self, x, weight, bias, act="none", residual=None, gated=False, addend=None):
        if addend is not None:  # the Triton kernels, whose epilogue adds it (cuBLAS and the TMA GEMM take none)
            if self._fp8 is not None and isinstance(weight, self._fp8.Fp8Weight):
                raise NotImplementedError(self.no_adapters)
            if gated:
                if residual is not None:
                    raise ValueError("backend 'triton': a gated linear takes no residual")
                return self._ops.linear.linear_gated(x, weight, bias, act, addend=addend)
            return self._ops.linear.linear(x, weight, bias, activation=act, residual=residual, addend=addend)
        if self._fp8 is not None and isinstance(weight, self._fp8.Fp8Weight):  # gated refused in `prepare`
            return self._fp8.linear(x, weight, bias, activation=act, residual=residual)
        if gated:
            if residual is not None:
                raise ValueError("backend 'triton': a gated linear takes no residual")
            return self._ops.linear.linear_gated(x, weight, bias, act)
        op = gemm_choice.op_name(act, residual is not None)
        tile = self._gemm.tma(op, *weight.shape, x.dtype)
        if tile is not None:  # measured faster on this GPU for this shape, at every M (`gemm_choice`)
            return gemm_choice.tma_linear(x, weight, bias, act, residual, tile)
        if self._cublas(op, x, weight):
            return gemm_choice.cublas_linear(x, weight, bias, act, residual)
        return self._ops.linear.linear(x, weight, bias, activation=act, residual=residual)

    def layernorm(self, x, weight, bias, eps):
        return self._ops.layernorm.layernorm(x, weight, bias, eps)


class _LoraTables:
    """The device tables of the LoRA kernels: a forward's tile table (one per `groups` object: a forward hands every
    slot the same one) and each adapter set's pointer table, checked through weak references to be the same live
    factors (an unloaded adapter's tensors are not kept alive by its table)."""

    def __init__(self, ops):
        self._ops = ops
        self._tiles: tuple | None = None
        self._pointers: dict[tuple, tuple] = {}

    def tiles(self, groups, T: int, device) -> torch.Tensor:
        if self._tiles is not None and self._tiles[0] is groups and self._tiles[1] == T:
            return self._tiles[2]
        spans = []
        for p, rows in groups:
            if isinstance(rows, slice):
                spans.append((p, rows.start, rows.stop))
            else:  # an index tensor (`Backend.lora` allows one; the engine's groups are slices), each row a run
                spans.extend((p, r, r + 1) for r in rows.tolist())
        spans.sort(key=lambda span: span[1])
        covered, end = [], 0
        for p, start, stop in spans:  # the base rows between: adapter -1, their terms zero
            if start > end:
                covered.append((-1, end, start))
            covered.append((p, start, stop))
            end = stop
        if end < T:
            covered.append((-1, end, T))
        table = self._ops.tiles(covered, device)
        self._tiles = (groups, T, table)
        return table

    def pointers(self, factors, device) -> torch.Tensor:
        key = tuple(None if f is None else id(f) for f in factors)
        hit = self._pointers.get(key)
        if hit is not None and all((r is None and f is None) or (r is not None and r() is f)
                                   for r, f in zip(hit[0], factors)):
            return hit[1]
        if len(self._pointers) >= 4096:  # a long-lived server loading and unloading adapters: start over
            self._pointers.clear()
        table = self._ops.table(factors).to(device)
        self._pointers[key] = (tuple(None if f is None else weakref.ref(f) for f in factors), table)
        return table


class _WorkCounters:
    """Each persistent layer's counters (`kernels.triton.layer`), handed out in turn from one buffer zeroed when the
    first layer of the forward asks (a forward of op-by-op layers zeroes none)."""

    def __init__(self, layers: int, phases: int, device):
        self._shape, self._device = (layers, 1 + phases), device
        self._work, self._next = None, 0

    def next(self) -> torch.Tensor:
        if self._work is None or self._next == self._shape[0]:
            self._work = torch.zeros(self._shape, dtype=torch.int32, device=self._device)
            self._next = 0
        self._next += 1
        return self._work[self._next - 1]
