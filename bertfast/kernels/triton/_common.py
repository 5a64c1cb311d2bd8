"""Helpers every Triton launcher shares: the interpreter mode seen at import, input checks that raise
before any launch, and the autotune config list (one config under the interpreter, where autotuning
would only multiply the slow interpretation)."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Dtypes the kernels compute in. The interpreter holds bf16 as raw bits and cannot do arithmetic
# on it, so on CPU only fp32/fp16 are accepted.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = (torch.float32, torch.float16)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def configs_for_mode(configs: list, interpreter_config) -> list:
    """The autotune list to declare: all `configs` when compiling, one config when interpreting."""
    return [interpreter_config] if INTERPRET else list(configs)


def check_device(op: str, *tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that this build of the kernels can run on; returns it."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"{op}: all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not INTERPRET:
        raise ValueError(
            f"{op}: CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 in the environment "
            "before bertfast.kernels.triton is first imported (the kernels here were built for GPU)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors on {device} are not supported (expected cuda, or cpu under "
                         "TRITON_INTERPRET=1)")
    return device


def check_float(op: str, name: str, t: torch.Tensor, ndim: int, dtype: torch.dtype | None = None) -> None:
    """`t` is a tensor of `ndim` dims in a kernel dtype (and equal to `dtype` when given)."""
    if not torch.is_tensor(t):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    allowed = INTERPRETER_DTYPES if t.device.type == "cpu" else KERNEL_DTYPES
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        where = " under the Triton interpreter (CPU)" if t.device.type == "cpu" else ""
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported{where}: {names}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} has dtype {t.dtype} but the input is {dtype}; all must match")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact ("ieee") for fp32, where tl.dot would otherwise use TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"
