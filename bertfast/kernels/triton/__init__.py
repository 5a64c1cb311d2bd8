"""Triton kernels of the engine, one module per op (kernel(s), launcher, public function).

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter. Triton decides
between compiled and interpreted kernels when a `@triton.jit` function is *defined*, so
``TRITON_INTERPRET=1`` must be in the environment before this package is first imported; the
mode seen then is kept in `INTERPRET` and every launcher checks its tensors against it (a CPU
tensor given to compiled kernels raises ValueError instead of crashing inside Triton).
Submodules are reached as modules (`triton.linear.linear_gelu`); their public functions are not
re-exported here, where names like `linear` would shadow the modules of the same name.
"""

from __future__ import annotations

from . import attention, disentangled, embedding, layer, layernorm, linear, lora, qkv
from ._common import INTERPRET, INTERPRETER_DTYPES

__all__ = ["attention", "disentangled", "embedding", "layer", "layernorm", "linear", "lora", "qkv", "INTERPRET",
           "INTERPRETER_DTYPES"]
