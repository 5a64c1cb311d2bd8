"""Which library runs each fused GEMM of the triton backend on CUDA: the fused Triton kernel, or cuBLAS through torch
(`addmm`, then the epilogue as separate torch ops), per (op, M bucket, N, K, dtype, GPU arch); or, on Hopper, the TMA
kernel (`kernels/triton/linear_tma.py`) per (op, N, K, dtype, arch), for every M.

The choices are measured, not autotuned at start: `bertfast gpucheck --stages gemm` times both paths per shape on a
GPU and writes the table; the one committed as `bertfast/backends/gemm_table.json` is read once per prepared model.
Where the table has no entry (any shape on a GPU it was not measured on, fp32, rotary QKV, gated FFNs), the Triton
kernel runs. A cuBLAS choice gives up two invariants of the Triton path: cuBLAS picks its algorithm by M, so a row's
bits may depend on its batch, and a CUDA-graph bucket (padded M) may differ from eager launches in the last bits.
A "tma" entry keeps both: its m_bucket is ALL_M (0), it names one tile, and it holds for every M of its shape (cuBLAS
entries of that shape are then ignored), so a row's kernel, and so its bits, never change with its batch.
"""

from __future__ import annotations

import json
import os

import torch

from ...kernels import activation

TABLE_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gemm_table.json")
CHOICES = ("triton", "cublas", "tma")
ALL_M = 0  # the m_bucket of a "tma" entry: every M
TMA_ARCHS = ("sm_90",)  # where a "tma" entry may be measured and taken (TMA and wgmma are Hopper's)
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
            if e["choice"] == "tma":
                _check_tma_entry(e)
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"GEMM choice table {path} is malformed: {type(err).__name__}: {err}") from None
    return entries


def _check_tma_entry(e: dict) -> None:
    """A "tma" entry holds for every M (m_bucket ALL_M), on a TMA arch, with a tile of linear_tma, N and K it runs."""
    from ...kernels.triton.linear_tma import ALIGN, TILES

    if e["m_bucket"] != ALL_M:
        raise ValueError(f"a tma entry holds for every M: m_bucket must be {ALL_M}, got {e['m_bucket']}")
    if e["arch"] not in TMA_ARCHS:
        raise ValueError(f"a tma entry is for {', '.join(TMA_ARCHS)}, got arch {e['arch']!r}")
    if e.get("tile") not in TILES:
        raise ValueError(f"a tma entry names a tile of {', '.join(TILES)}, got {e.get('tile')!r}")
    if e["n"] % ALIGN or e["k"] % ALIGN:
        raise ValueError(f"a tma entry needs N and K multiples of {ALIGN}, got {e['n']} x {e['k']}")


class GemmChoices:
    """The choices of one GPU arch: cuBLAS by (op, M, N, K, dtype), the TMA kernel by (op, N, K, dtype) for every M.
    Empty (`bool(choices)` False) when nothing on this arch leaves the Triton kernel, so callers skip the lookups."""

    def __init__(self, entries: list[dict], arch: str | None):
        mine = [e for e in entries if e["arch"] == arch]
        self._tma = {(e["op"], e["n"], e["k"], e["dtype"]): e["tile"] for e in mine
                     if e["choice"] == "tma" and arch in TMA_ARCHS}
        # A shape on the TMA kernel stays there at every M: its cuBLAS buckets would make a row's bits batch-dependent.
        self._cublas = {(e["op"], e["m_bucket"], e["n"], e["k"], e["dtype"]) for e in mine
                        if e["choice"] == "cublas" and (e["op"], e["n"], e["k"], e["dtype"]) not in self._tma}

    def __bool__(self) -> bool:
        return bool(self._cublas or self._tma)

    def cublas(self, op: str, m: int, n: int, k: int, dtype: torch.dtype) -> bool:
        return (op, m_bucket(m), n, k, _DTYPE_NAMES.get(dtype)) in self._cublas

    def tma(self, op: str, n: int, k: int, dtype: torch.dtype) -> str | None:
        """The TMA tile (a name of `linear_tma.TILES`) that runs (op, N, K, dtype) at every M here, or None. Takes no M:
        the choice cannot depend on the batch."""
        return self._tma.get((op, n, k, _DTYPE_NAMES.get(dtype)))

    def choice(self, op: str, m: int, n: int, k: int, dtype: torch.dtype) -> str:
        """One of CHOICES for this call: "tma" wherever the shape has a tma entry, else the M bucket's."""
        if self.tma(op, n, k, dtype) is not None:
            return "tma"
        return "cublas" if self.cublas(op, m, n, k, dtype) else "triton"


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


def tma_linear(x, weight, bias, act: str = "none", residual=None, tile: str = "plain") -> torch.Tensor:
    """act(x @ weight.T + bias) + residual by the Hopper TMA kernel with the named tile: (M, N). x needs unit stride
    along K and 16-byte aligned rows (the engine's activations have both); otherwise linear_tma raises ValueError."""
    from ...kernels.triton.linear_tma import linear_tma

    return linear_tma(x, weight, bias, activation=act, residual=residual, tile=tile)


def tma_qkv(x, weight, bias, num_heads: int, tile: str = "plain"):
    """q, k, v (T, heads, d), contiguous views of one buffer, by the Hopper TMA kernel with the named tile."""
    from ...kernels.triton.linear_tma import qkv_tma

    return qkv_tma(x, weight, bias, num_heads, tile=tile)
