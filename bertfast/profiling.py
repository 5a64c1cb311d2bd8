"""Where a run's time goes: wall time per stage of a corpus or `encode` run, from timers that cost nothing when off.

    with bertfast.profile(encoder) as prof:
        encoder.encode(texts)
    print(prof.table())

Stages: the pipeline's (`read`, `tokenize`, `pooling`, `write`, ... through `stage(name)`, a no-op without a running
profile), the engine's ops (the backend's op methods wrapped for the profile's duration: `embeddings`, `gemm qkv`,
`position scores` (DeBERTa), `attention`, `gemm attn-out`, `layernorm`, `gemm ffn-in`, `gemm ffn-out`, `gemm pooler`,
`gemm other`), and inside the native layer (`_C.Layer`, one call per layer on the cpu backend) the same op names from
its own timers (csrc/cpu/layer/profile.h), plus `quantize rows` (int8) and `bf16 operands` (bf16: the fp32 stream
rounded for a GEMM). `forward: rest` is what the forward spends outside its ops (unpad, pad, Python), `rest` what the run
spends outside every stage. GEMM rows carry their rate (GFLOP/s).
Worker threads (`bertfast.workers`: several batches at once, each on its share of the cores) time their stages
each: the seconds are then thread-seconds, shared out of `wall x workers`, the rest of which is `rest` (a worker's
idle time included), and a stage's rate is per thread-second times the workers (the rate of all the cores).
Off, nothing is wrapped and the native timers read one flag per stage. On a GPU every op is followed by a device
sync, so the stages add up but the whole runs slower than unprofiled; a forward replayed from a CUDA graph runs no
op from Python, so its time is all `forward: rest` (`benchmarks/gpu_overhead.py` profiles those).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

OPS = ("embeddings", "gemm qkv", "position scores", "attention", "gemm attn-out", "layernorm", "gemm ffn-in",
       "gemm ffn-out", "quantize rows", "bf16 operands", "gemm pooler", "gemm other")
_FORWARDS = ("forward", "forward_packed")  # the Engine methods a forward runs through: timed as `forward`
_NATIVE_LAYER = "layer (native)"  # one `_C.Layer` call: split by its own timers into OPS
_active: "Profile | None" = None


class Profile:
    """Seconds, calls and FLOPs per stage, and the wall time of the profiled block (`wall`)."""

    def __init__(self, label: str = ""):
        self.label = label
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.flops: dict[str, int] = {}
        self.wall = 0.0
        self.workers = 1  # the most worker threads that ran at once (note_workers)
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float, flops: int = 0, calls: int = 1) -> None:
        with self._lock:  # worker threads add too
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.calls[name] = self.calls.get(name, 0) + calls
            self.flops[name] = self.flops.get(name, 0) + int(flops)

    def rows(self) -> list[dict]:
        """One dict per stage (stage, seconds, share of wall x workers, calls, gflops_per_s or None), in pipeline
        order, then `forward: rest` and `rest` (never negative)."""
        seconds = dict(self.seconds)
        # A native layer call is split by its own timers into OPS; what it spent between them stays in `forward: rest`.
        seconds.pop(_NATIVE_LAYER, None)
        forward = seconds.pop("forward", 0.0)
        ops = sum(v for k, v in seconds.items() if k in OPS)
        forward_rest = max(0.0, forward - ops) if forward else 0.0
        order = [k for k in seconds if k not in OPS] + [k for k in OPS if k in seconds]
        out = [self._row(k, seconds[k]) for k in order]
        if forward:
            out.append(self._row("forward: rest", forward_rest))
        accounted = sum(seconds.values()) + forward_rest
        out.append(self._row("rest", max(0.0, self.wall * self.workers - accounted)))
        return out

    def _row(self, name: str, seconds: float) -> dict:
        flops, capacity = self.flops.get(name, 0), self.wall * self.workers
        return {"stage": name, "seconds": seconds, "share": seconds / capacity if capacity else 0.0,
                "calls": self.calls.get(name, 0),
                "gflops_per_s": flops * self.workers / seconds / 1e9 if flops and seconds > 0 else None}

    def table(self, ceilings: dict[str, float] | None = None) -> str:
        """The breakdown as text (`format_table`)."""
        return format_table(self.as_dict(), ceilings)

    def as_dict(self) -> dict:
        return {"label": self.label, "wall_s": self.wall, "workers": self.workers, "stages": self.rows()}


def format_table(profile: dict, ceilings: dict[str, float] | None = None) -> str:
    """A profile (`Profile.as_dict()`, or its JSON as `bertfast embed --profile FILE` writes it) as text. ceilings:
    {"gemm": GFLOP/s} (e.g. benchmarks/bench_peak.py's all-core row of the instruction this dtype's GEMMs use)
    prints each GEMM's rate as a share of it."""
    wall, rows, label = profile["wall_s"], profile["stages"], profile.get("label")
    workers = profile.get("workers", 1)
    ceiling = (ceilings or {}).get("gemm")
    of = f"wall {wall:.3f} s" + (f" x {workers} workers: thread-seconds" if workers > 1 else "")
    lines = [f"where the time goes{': ' + label if label else ''} ({of})",
             f"{'stage':<16} {'seconds':>9} {'share':>7} {'calls':>7} {'GFLOP/s':>9}" + (f" {'of peak':>8}" if ceiling
                                                                                        else "")]
    for r in rows:
        rate = r["gflops_per_s"]
        line = (f"{r['stage']:<16} {r['seconds']:>9.3f} {100 * r['share']:>6.1f}% {r['calls']:>7} "
                f"{'' if rate is None else f'{rate:.0f}':>9}")
        if ceiling:
            line += f" {'' if rate is None else f'{100 * rate / ceiling:.0f}%':>8}"
        lines.append(line)
    gemm = sum(r["seconds"] for r in rows if r["stage"].startswith("gemm"))
    share = 100 * gemm / (wall * workers) if wall else 0.0
    of = "the wall time" if workers == 1 else f"the {workers} workers' wall time"
    lines.append(f"GEMMs {gemm:.3f} s ({share:.1f}% of {of}); everything else {100 - share:.1f}%"
                 + (f"; GEMM ceiling {ceiling:.0f} GFLOP/s" if ceiling else ""))
    # The GEMMs' work over the run's wall time: the rate the whole run computes at (attention's few FLOPs left out).
    flops = sum(r["gflops_per_s"] * r["seconds"] / workers for r in rows if r["gflops_per_s"])
    if flops and wall:
        lines.append(f"end to end: the GEMMs' {flops:.1f} GFLOP in {wall:.3f} s, {flops / wall:.0f} GFLOP/s"
                     + (f", {100 * flops / wall / ceiling:.0f}% of the ceiling" if ceiling else ""))
    return "\n".join(lines)


@contextmanager
def stage(name: str):
    """Time the block as `name` in the running profile; nothing without one."""
    prof = _active
    if prof is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        prof.add(name, time.perf_counter() - start)


def note_workers(workers: int) -> None:
    """Worker threads are about to run `workers` at once: the running profile (if any) shares its stages out of
    wall x the most workers noted."""
    prof = _active
    if prof is not None:
        prof.workers = max(prof.workers, workers)


def timed_iter(iterable, name: str):
    """`iterable` with the time each item takes to produce counted as `name` (while a profile runs)."""
    it = iter(iterable)
    while True:
        prof, start = _active, time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            return
        finally:
            if prof is not None:
                prof.add(name, time.perf_counter() - start, calls=0)
        yield item


def _linear_stage(x, out, act, residual) -> str:
    if act == "tanh":
        return "gemm pooler"
    if act != "none":
        return "gemm ffn-in"
    if residual is not None:
        return "gemm attn-out" if x.shape[-1] == out.shape[-1] else "gemm ffn-out"
    return "gemm other"


def _wrap_backend(backend, prof: Profile, sync) -> list[str]:
    """Time `backend`'s op methods into `prof` (instance attributes shadowing the class's); returns their names."""
    # An op that calls another (the cpu backend's qkv calls its linear) is timed once, as itself: depth per thread.
    local = threading.local()

    def timed(name, fn, flops=lambda args, kwargs, out: 0, name_of=None):
        def op(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth:
                return fn(*args, **kwargs)
            local.depth = 1
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                sync()
            finally:
                local.depth = 0
            stage_name = name if name_of is None else name_of(args, kwargs, out)
            prof.add(stage_name, time.perf_counter() - start, flops(args, kwargs, out))
            return out
        return op

    def linear_flops(args, kwargs, out):
        x = args[0]
        return 2 * x.shape[0] * x.shape[-1] * out.shape[-1] * (2 if kwargs.get("gated") else 1)

    def linear_name(args, kwargs, out):
        act = kwargs.get("act", args[3] if len(args) > 3 else "none")
        residual = kwargs.get("residual", args[4] if len(args) > 4 else None)
        return "gemm ffn-in" if kwargs.get("gated") else _linear_stage(args[0], out, act, residual)

    def qkv_flops(args, kwargs, out):
        x = args[0]
        return 2 * x.shape[0] * x.shape[-1] * sum(t[0].numel() for t in out)

    def whole_layer(x, layer, lora=None):
        run = type(backend).whole_layer(backend, x, layer, lora)
        return None if run is None else timed(_NATIVE_LAYER, run)

    ops = {"embeddings": timed("embeddings", backend.embeddings),
           "qkv": timed("gemm qkv", backend.qkv, qkv_flops),
           "attention": timed("attention", backend.attention),
           "linear": timed("gemm", backend.linear, linear_flops, linear_name),
           "layernorm": timed("layernorm", backend.layernorm),
           "disentangled": timed("position scores", backend.disentangled),  # DeBERTa's c2p / p2c tables
           "whole_layer": whole_layer}
    for name, fn in ops.items():
        setattr(backend, name, fn)
    return list(ops)


def _native():
    try:
        from . import _C
    except ImportError:
        return None
    return _C if hasattr(_C, "profile_enable") else None


@contextmanager
def profile(encoder=None, label: str = ""):
    """Profile the block: pipeline stages, `encoder`'s ops (when given) and the native layer's stages. Yields the
    Profile, complete when the block ends. One profile at a time."""
    global _active
    if _active is not None:
        raise RuntimeError("a profile is already running")
    prof = Profile(label)
    wrapped, backend, native = [], None, _native()
    if encoder is not None:
        backend = encoder.engine.backend
        device = encoder.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        wrapped = _wrap_backend(backend, prof, sync)

        def timed(forward):
            def timed_forward(*args, **kwargs):
                start = time.perf_counter()
                out = forward(*args, **kwargs)
                prof.add("forward", time.perf_counter() - start)
                return out
            return timed_forward

        for name in _FORWARDS:
            setattr(encoder.engine, name, timed(getattr(encoder.engine, name)))
    if native is not None:
        native.profile_enable(True)
    _active = prof
    start = time.perf_counter()
    try:
        yield prof
    finally:
        prof.wall = time.perf_counter() - start
        _active = None
        for name in wrapped:
            delattr(backend, name)
        if encoder is not None:
            for name in _FORWARDS:
                delattr(encoder.engine, name)
        if native is not None:
            for name, (seconds, calls, flops) in native.profile_counters().items():
                prof.add(name, seconds, flops, calls)
            native.profile_enable(False)
