"""The "triton" backend: every op is a Triton kernel from `bertfast.kernels.triton`.

On CUDA this is the fast path. On CPU it runs under the Triton interpreter, which must be switched
on with TRITON_INTERPRET=1 before `bertfast.kernels.triton` is imported; that mode is for validation (slow,
and fp32/fp16 only: the interpreter cannot compute in bf16).
"""

from __future__ import annotations

import os

import torch

from . import gemm_choice
from .contract import Backend, Precision


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    return None


class TritonBackend(Backend):
    name = "triton"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)  # tl.dot has no fp64 path worth having

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
        from ..kernels import triton as ops

        self._ops = ops
        self._gemm = gemm_choice.GemmChoices([], None)  # read from the table in `prepare`, for the weights' GPU

    def precision(self, device):
        # The interpreter (CPU) computes no bf16: fp32 there; on CUDA the base rule (bf16 where supported).
        return Precision(torch.float32) if device == "cpu" else super().precision(device)

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
        return weights

    def _cublas(self, op, x, weight) -> bool:
        """The one GEMM routing rule of this backend: cuBLAS where the measured table says so for this shape on this
        GPU (`backends.gemm_choice`), else the fused Triton kernel."""
        return bool(self._gemm) and self._gemm.cublas(op, x.shape[0], weight.shape[0], weight.shape[1], x.dtype)

    # The engine hands over cu_seqlens from `padding.unpad` and ids that `inputs.check_inputs`
    # validated, so the launchers skip their device-to-host value checks (validate/check_ids=False).
    def embeddings(self, input_ids, position_ids, token_type_ids, emb, eps):
        return self._ops.embedding.embeddings(input_ids, position_ids, token_type_ids, emb, eps, check_ids=False)

    def qkv(self, x, weight, bias, num_heads, rotary=None):
        # RoPE is the QKV GEMM's epilogue (q and k rotated before they are stored).
        if rotary is None and self._cublas("qkv", x, weight):
            return gemm_choice.cublas_qkv(x, weight, bias, num_heads)
        return self._ops.qkv.qkv(x, weight, bias, num_heads, rotary=rotary)

    def disentangled(self, q, k, pos_key, pos_query, scale):
        """DeBERTa-v2's c2p / p2c tables, one fixed-tile kernel each: a token's entries the same bits in any batch."""
        def table(x, pos):
            return None if pos is None else self._ops.disentangled.position_scores(x, pos, scale)

        return table(q, pos_key), table(k, pos_query)

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale, bias=None, window=0):
        # bias: MPNet's AttentionBias (per-distance table, per-token positions) or DeBERTa-v2's DisentangledBias
        # (per-token c2p / p2c tables, per-distance index), gathered per score tile.
        return self._ops.attention.attention_varlen(q, k, v, cu_seqlens, max_seqlen, scale, validate=False,
                                                    window=window, bias=bias)

    def linear(self, x, weight, bias, act="none", residual=None, gated=False):
        if gated:
            if residual is not None:
                raise ValueError("backend 'triton': a gated linear takes no residual")
            return self._ops.linear.linear_gated(x, weight, bias, act)
        if self._cublas(gemm_choice.op_name(act, residual is not None), x, weight):
            return gemm_choice.cublas_linear(x, weight, bias, act, residual)
        return self._ops.linear.linear(x, weight, bias, activation=act, residual=residual)

    def layernorm(self, x, weight, bias, eps):
        return self._ops.layernorm.layernorm(x, weight, bias, eps)
