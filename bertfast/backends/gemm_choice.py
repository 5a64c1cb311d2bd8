"""Which library runs each fused GEMM of the triton backend on CUDA: the fused Triton kernel, or cuBLAS through torch
(`addmm`, then the epilogue as separate torch ops), per (op, M bucket, N, K, dtype, GPU arch).

The choices are measured, not autotuned at start: `bertfast gpucheck --stages gemm` times both paths per shape on a
GPU and writes the table; the one committed next to this module (`gemm_table.json`) is read once per prepared model.
Where the table has no entry (any shape on a GPU it was not measured on, fp32, rotary QKV, gated FFNs), the Triton
kernel runs. A cuBLAS choice gives up two invariants of the Triton path: cuBLAS picks its algorithm by M, so a row's
bits may depend on its batch, and a CUDA-graph bucket (padded M) may differ from eager launches in the last bits.
"""

from __future__ import annotations

import json
import os

import torch

from ..kernels import activation

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_table.json")
CHOICES = ("triton", "cublas")
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def m_bucket(m: int) -> int:
    """The power of two at or above m: the rows a choice holds for (the Triton kernels key their configs the same)."""
    return 1 if m <= 1 else 1 << (int(m) - 1).bit_length()


def op_name(act: str = "none", residual: bool = False) -> str:
    """The table's name of a linear: "linear_residual" (attention out, FFN out) or "linear_<act>" (FFN in)."""
    return "linear_residual" if residual else f"linear_{act}"


def arch_of(device) -> str | None:
    """"sm_90" for a CUDA device of compute capability 9.0; None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def read_table(path: str = TABLE_PATH) -> list[dict]:
    """The entries of a table file ({"entries": [{op, m_bucket, n, k, dtype, arch, choice, ...}]}); [] when the file
    does not exist. A malformed file raises ValueError naming it."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
        for e in entries:
            if e["choice"] not in CHOICES:
                raise ValueError(f"choice {e['choice']!r} is not one of {CHOICES}")
            e["m_bucket"], e["n"], e["k"] = int(e["m_bucket"]), int(e["n"]), int(e["k"])
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"GEMM choice table {path} is malformed: {type(err).__name__}: {err}") from None
    return entries


class GemmChoices:
    """The cuBLAS choices of one GPU arch, looked up by (op, M, N, K, dtype). Empty (`bool(choices)` False) when
    nothing on this arch goes to cuBLAS, so callers skip the lookup entirely."""

    def __init__(self, entries: list[dict], arch: str | None):
        self._cublas = {(e["op"], e["m_bucket"], e["n"], e["k"], e["dtype"]) for e in entries
                        if e["arch"] == arch and e["choice"] == "cublas"}

    def __bool__(self) -> bool:
        return bool(self._cublas)

    def cublas(self, op: str, m: int, n: int, k: int, dtype: torch.dtype) -> bool:
        return (op, m_bucket(m), n, k, _DTYPE_NAMES.get(dtype)) in self._cublas


def for_device(device, path: str = TABLE_PATH) -> GemmChoices:
    """The choices of `device`'s arch from the table at `path` (none off CUDA)."""
    arch = arch_of(device)
    return GemmChoices(read_table(path) if arch else [], arch)


def cublas_linear(x, weight, bias, act: str = "none", residual=None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual through cuBLAS (`addmm`) and torch's elementwise ops: (M, N)."""
    out = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
    out = activation.apply_(out, act)
    return out if residual is None else out.add_(residual)


def cublas_qkv(x, weight, bias, num_heads: int):
    """q, k, v (T, heads, d) views of one cuBLAS GEMM's (T, 3H) output (strided: attention takes any strides)."""
    out = torch.addmm(bias, x, weight.t()) if bias is not None else x @ weight.t()
    T, H = x.shape[0], weight.shape[0] // 3
    return out.view(T, 3, num_heads, H // num_heads).unbind(1)
