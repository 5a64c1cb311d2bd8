"""How every timing in bertfast is taken: the one interleaved timer and what it stands on.

`interleaved` times several contenders round-robin, the start rotating by one per round, with the
garbage collector collected once and then off for all rounds; each contender is a callable returning
the seconds of one timed call, usually `timer(fn)` (a call timed here, optionally after a settle pause
and one untimed call), or a worker's own timed call (`bench.process`). `bertfast bench`, `bertfast
demo` and the scripts in benchmarks/ all time through it. Also here: `time_call` (one call, CUDA
events on a GPU), `PeakMemory` (peak extra memory of a block) and `cpu_ticks`/`steal_fraction` (the
hypervisor's share of the CPU over a run). Why each rule: docs/bench-method.md (#interleaving,
#settle-pause, #garbage-collector, #noise).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from typing import Callable, Mapping

import torch


def time_call(fn, *args, device: str = "cpu") -> tuple[float, object]:
    """Seconds of one call `fn(*args)` (CUDA: event timing around a synchronised call), and its result."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        out = fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, out
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def gc_paused(collect: bool = False):
    """Python's garbage collector off inside the block (after one collection if `collect`), then back
    as it was: a collection inside a timed call would charge it for everyone's garbage."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def time_once(fn, *, settle_s: float = 0.0, untimed_call: bool = True, device: str = "cpu") -> float:
    """Seconds of one call `fn()`, after `settle_s` idle and one untimed call (neither when settle_s is 0;
    no untimed call if not `untimed_call`), the garbage collector off throughout
    (docs/bench-method.md#settle-pause)."""
    with gc_paused():
        if settle_s > 0:
            time.sleep(settle_s)
            if untimed_call:
                fn()
        return time_call(fn, device=device)[0]


def timer(fn, *, settle_s: float = 0.0, untimed_call: bool = True, device: str = "cpu") -> Callable[[], float]:
    """`fn` (no arguments) as a contender of `interleaved`: each call returns the seconds of one timed call."""
    return lambda: time_once(fn, settle_s=settle_s, untimed_call=untimed_call, device=device)


def interleaved(contenders: Mapping[str, Callable[[], float]], rounds: int, *, warmup: int = 0,
                on_error: Callable[[str, Exception], None] | None = None) -> dict[str, list[float]]:
    """Seconds of every timed call, per contender: `warmup` untimed rounds, then `rounds` rounds each
    calling every contender once, the start rotating by one per round (docs/bench-method.md#interleaving).
    A contender is a callable returning the seconds of one timed call (`timer(fn)`, or a worker's).
    The garbage collector is collected once, then off until the rounds end. An exception from a
    contender goes to `on_error(name, exc)` when given (that call adds no time; the rounds go on),
    else it propagates."""
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    with gc_paused(collect=True):
        for r in range(rounds):
            k = r % len(names) if names else 0
            for name in names[k:] + names[:k]:
                try:
                    times[name].append(contenders[name]())
                except Exception as e:
                    if on_error is None:
                        raise
                    on_error(name, e)
    return times


def quantile(xs, q: float) -> float:
    """The q-quantile of `xs`, linear between the closest ranks (q=0.5: the median)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class PeakMemory:
    """Peak extra memory of the code in the `with` block, in MB (None when it cannot be measured).

    CPU: resets the kernel's RSS high-water mark (/proc/self/clear_refs) after returning freed heap
    pages (malloc_trim), so re-used allocator memory counts again; allocators that keep a pool across
    calls show only growth. CUDA: torch's allocator peak (docs/bench-method.md#validation).
    """

    def __init__(self, device: str):
        self.device, self.mb = device, None

    @staticmethod
    def _status_kb(field_name):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise OSError(f"{field_name} not in /proc/self/status")

    def __enter__(self):
        self._base = None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return self
        try:
            gc.collect()
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):
                pass
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = self._status_kb("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc):
        if self._base is None:
            return False
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.mb = (torch.cuda.max_memory_allocated() - self._base) / 2**20
        else:
            try:
                self.mb = max(0, self._status_kb("VmHWM") - self._base) / 1024
            except OSError:
                self.mb = None
        return False


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat, or None where there is none. Steal is time
    the hypervisor gave this virtual machine's CPUs to someone else (docs/bench-method.md#noise)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    return fields[7], sum(fields[:8])


def steal_fraction(before, after) -> float | None:
    """Share of CPU time stolen by the hypervisor between two `cpu_ticks()` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
