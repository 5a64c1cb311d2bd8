"""Backend registry: a backend is a named set of op functions the engine calls (`contract`).

Backends are chosen once, when an Encoder is built (`get_backend`). Modules are imported lazily so
that, for example, the torch backend works on a machine without triton. `"auto"` picks the first
available backend in `AUTO_ORDER` for the device.
"""

from __future__ import annotations

import importlib
import warnings

from .contract import AttentionBias, Backend, DisentangledBias, BackendUnavailable, Precision, Rotary, Tokens
from .cpu import isa as _isa

# An unknown BERTFAST_ISA name raises here, at import (the libraries' caps are `cap_libraries`'s, an explicit call).
_isa.check_requested_cap()

# name -> "module:Class". Adding a backend is one line here plus its module.
REGISTRY = {
    "torch": "bertfast.backends.torch:TorchBackend",
    "triton": "bertfast.backends.cuda.triton:TritonBackend",
    "cpu": "bertfast.backends.cpu.backend:CpuBackend",
}

# Preference per device type under backend="auto", fastest first. "torch" always works.
AUTO_ORDER = {"cpu": ("cpu", "torch"), "cuda": ("triton", "torch")}


def _backend_class(name: str):
    module_name, cls_name = REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot be imported: {e}") from None
    return getattr(module, cls_name)


def available_backends(device="cpu") -> dict[str, str | None]:
    """name -> None if usable on `device`, else the reason it is not."""
    device = _device_type(device)
    out = {}
    for name in REGISTRY:
        try:
            out[name] = _backend_class(name).unavailable_reason(device)
        except BackendUnavailable as e:
            out[name] = str(e)
    return out


_warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 3) -> None:
    """warnings.warn(message) the first time this process sees `message`."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel)


def _device_type(device) -> str:
    return device if isinstance(device, str) and ":" not in device else str(device).split(":")[0]


def get_backend(name: str = "auto", device="cpu", quantize: str | None = None, family: str | None = None) -> Backend:
    """Instantiate backend `name` for `device` (with weight quantization `quantize`, e.g. "int8") to run models
    of `family` (a model_type; None: any); raises ValueError naming the available ones."""
    device = _device_type(device)
    if name == "auto":
        order = AUTO_ORDER.get(device, ("torch",))
        passed_over = []
        for candidate in order:
            try:
                cls = _backend_class(candidate)
                reason = cls.unavailable_reason(device)
            except BackendUnavailable as e:
                cls, reason = None, str(e)
            if reason is None and quantize is not None and quantize not in cls.quantizations:
                reason = f"no {quantize!r} quantization"
            if reason is None and family in cls.unsupported_families:
                reason = f"no {family} models yet: {cls.unsupported_families[family]}"
            if reason is None:
                if passed_over:
                    warn_once(f"bertfast: backend 'auto' on {device} is using {candidate!r}, not the faster "
                               + "; ".join(passed_over))
                return cls(quantize=quantize)
            passed_over.append(f"{candidate!r} ({reason})")
        what = f" with {quantize!r} quantization" if quantize else ""
        raise ValueError(f"no backend is available for device {device!r}{what}")
    if name not in REGISTRY:
        raise ValueError(
            f"unknown backend {name!r}; known backends: {', '.join(REGISTRY)} (or 'auto')"
        )
    try:
        cls = _backend_class(name)
        reason = cls.unavailable_reason(device)
    except BackendUnavailable as e:
        reason = str(e)
    if reason is None and family in cls.unsupported_families:
        raise ValueError(f"backend {name!r} does not run {family} models yet: {cls.unsupported_families[family]}")
    if reason is not None:
        usable = [n for n, r in available_backends(device).items() if r is None]
        raise ValueError(
            f"backend {name!r} is not available on {device}: {reason}. "
            f"Available here: {', '.join(usable)}"
        )
    return cls(quantize=quantize)


__all__ = ["AttentionBias", "Backend", "DisentangledBias", "BackendUnavailable", "Precision", "Rotary", "Tokens", "REGISTRY", "get_backend", "available_backends", "warn_once"]
