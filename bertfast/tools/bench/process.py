"""Where `bertfast bench` holds a provider while it validates and times it: in this process (`Local`),
or in a spawned worker process of its own (`Worker`, `--isolation process`, the default), because
libraries sharing a process slow each other's thread pools (docs/bench-method.md#isolation). Both
answer the same calls (`load`, `call`, `timed`, `close`), so the run loop does not know which it
drives; the parent keeps the reference, the validation and the interleaving, and a worker runs one
call at a time on request.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

import numpy as np
import torch

from bertfast.tools.bench.measure import PeakMemory, time_call, time_once
from bertfast.tools.bench.providers import DTYPES, ProviderSkipped, setup
from bertfast.tools.bench.source import load_source


class Local:
    """A provider run in this process. `load(batch)` sets the batch every later call runs."""

    def __init__(self, provider, device: str):
        self.provider, self.device = provider, device
        self.build_s, self.info = provider.build_s, dict(provider.info)
        self.batch = None

    def load(self, batch) -> None:
        self.batch = batch

    def call(self, measure_memory: bool = False):
        """One call: (seconds, output (B, S, H) tensor, peak extra MB or None)."""
        if not measure_memory:
            dt, out = time_call(self.provider.fn, self.batch, device=self.device)
            return dt, out, None
        with PeakMemory(self.device) as mem:
            dt, out = time_call(self.provider.fn, self.batch, device=self.device)
        return dt, out, mem.mb

    def timed(self, settle_s: float, untimed_call: bool = True) -> float:
        """Seconds of one timed call (`measure.time_once`: settle pause, untimed call, no GC)."""
        return time_once(lambda: self.provider.fn(self.batch), settle_s=settle_s, untimed_call=untimed_call,
                         device=self.device)

    def close(self) -> None:
        self.provider = None


def _serve(conn, source_spec: dict, name: str, dtype_name: str, device: str, threads: int) -> None:
    """Worker process: build the provider, report, then answer requests until "close" or EOF."""
    torch.set_num_threads(threads)
    try:  # the parent already showed the model loading once; a bar per worker is noise
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        source = load_source(**source_spec)
        provider = setup(name, source, DTYPES[dtype_name])
    except ProviderSkipped as e:
        conn.send(("skipped", str(e)))
        return
    except Exception as e:
        conn.send(("skipped", f"set-up failed in the worker process: {type(e).__name__}: {e}"))
        return
    del source  # the providers keep what they need (copies, exported files); the reference can go
    local = Local(provider, device)
    conn.send(("ready", local.build_s, local.info))
    while True:
        try:
            request, *args = conn.recv()
        except EOFError:
            return
        if request == "close":
            return
        try:
            if request == "load":  # pickled by value: no shared-memory tensors between processes
                args = [pickle.loads(args[0])]
            result = getattr(local, request)(*args)
            if request == "call":  # tensors go back as plain arrays (bf16 widened: numpy has no bf16)
                dt, out, mb = result
                out = out.detach().cpu()
                result = dt, out.float().numpy() if out.dtype == torch.bfloat16 else out.numpy(), str(out.dtype), mb
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


class Worker:
    """A provider built and run in a child process (spawned: a clean interpreter, no inherited
    thread pools). Raises `ProviderSkipped` when the worker cannot build it."""

    def __init__(self, source_spec: dict, name: str, dtype_name: str, device: str):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name=f"bertfast-bench-{name}-{dtype_name}", daemon=True,
                                 args=(child, source_spec, name, dtype_name, device, torch.get_num_threads()))
        self._proc.start()
        child.close()
        try:
            status, *rest = self._receive()
        except RuntimeError as e:
            self.close()
            raise ProviderSkipped(f"set-up failed: {e}") from None
        if status == "skipped":
            self.close()
            raise ProviderSkipped(rest[0])
        self.build_s, self.info = rest

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, ConnectionError):
            self._proc.join(5)
            raise RuntimeError(f"the worker process died (exit code {self._proc.exitcode})") from None

    def _request(self, *message):
        self._conn.send(message)
        status, *rest = self._receive()
        if status == "error":
            raise RuntimeError(rest[0])
        return rest[0]

    def load(self, batch) -> None:
        self._request("load", pickle.dumps(batch))

    def call(self, measure_memory: bool = False):
        dt, out, dtype, mb = self._request("call", measure_memory)
        out = torch.from_numpy(np.asarray(out))
        return dt, out.to(getattr(torch, dtype.replace("torch.", ""))), mb

    def timed(self, settle_s: float, untimed_call: bool = True) -> float:
        return self._request("timed", settle_s, untimed_call)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except (OSError, ValueError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
