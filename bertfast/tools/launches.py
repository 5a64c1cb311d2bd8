"""Counting the kernels a forward launches, without a GPU: `count_launches()` counts every Triton kernel launch
(interpreted on CPU, or compiled on CUDA through Triton's launch hook) and every torch op that computes (would launch
a kernel or a copy on a GPU), and separately each read of a device value by the host (a sync on a GPU).

Views, allocations (`empty`) and the Triton interpreter's own bookkeeping are not counted. It is the count a CUDA
graph of the same code would hold: the launch budget of issue 55 (`tests/test_launches.py`) is checked with it under
the interpreter; on a GPU `benchmarks/gpu_overhead.py` reports it next to the profiler's kernel count.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate without writing, or that only describe memory: no kernel.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "resize_", "set_", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream"}
_HOST_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero"}


@dataclasses.dataclass
class Launches:
    """What ran inside one `count_launches` block."""

    triton: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kernel name -> launches
    torch: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # aten op -> calls
    host_reads: int = 0

    @property
    def kernels(self) -> int:
        """Triton launches plus torch ops that compute: the kernels (and copies) a GPU would run."""
        return sum(self.triton.values()) + sum(self.torch.values())

    def summary(self) -> str:
        parts = [f"{n} x{c}" for n, c in sorted((self.triton + self.torch).items(), key=lambda kv: -kv[1])]
        return f"{self.kernels} kernels, {self.host_reads} host reads: " + ", ".join(parts)


class _TorchOps(TorchDispatchMode):
    def __init__(self, launches: Launches, paused: list):
        super().__init__()
        self.launches, self.paused = launches, paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused[0]:
            name = func.overloadpacket.__name__
            if name in _HOST_READS:
                self.launches.host_reads += 1
            elif name not in _NO_KERNEL and not func.is_view:
                self.launches.torch[name] += 1
        return out


def _kernel_name(fn) -> str:
    fn = getattr(fn, "fn", fn)
    return getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "kernel")


@contextlib.contextmanager
def count_launches():
    """`with count_launches() as launches:` ... `launches.kernels`. Counts this thread's torch ops and every Triton
    launch of the process while the block runs."""
    import triton
    from triton.runtime import interpreter

    launches = Launches()
    paused = [False]  # the interpreter's own torch calls (argument copies) are not the program's
    grid_call = interpreter.GridExecutor.__call__

    def counted_grid_call(self, *args, **kwargs):
        launches.triton[_kernel_name(self.fn)] += 1
        paused[0] = True
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            paused[0] = False

    def hook(metadata):
        launches.triton[getattr(metadata, "name", "kernel")] += 1

    hooks = getattr(getattr(triton, "knobs", None), "runtime", None)
    interpreter.GridExecutor.__call__ = counted_grid_call
    if hooks is not None:
        hooks.launch_enter_hook.add(hook)
    try:
        with _TorchOps(launches, paused):
            yield launches
    finally:
        interpreter.GridExecutor.__call__ = grid_call
        if hooks is not None:
            hooks.launch_enter_hook.remove(hook)


def forward_launches(encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[Launches, Launches]:
    """(the whole call's launches, the launches of the part a CUDA graph replays: the layer stack on the packed
    tokens) for one `encoder(input_ids, attention_mask)` call, after a warm-up call (autotuning, compiling)."""
    engine = encoder.engine
    encoder(input_ids, attention_mask=attention_mask)
    with torch.inference_mode():
        tokens, _ = engine._pack_on_device(input_ids, attention_mask, None, None)
        with count_launches() as stack:
            engine.run(tokens, False)
    with count_launches() as call:
        encoder(input_ids, attention_mask=attention_mask)
    return call, stack
