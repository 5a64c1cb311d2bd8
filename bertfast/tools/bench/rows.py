"""What a bench row is before it is timed: a `Provider` (its name, dtype and forward), or `ProviderSkipped` with the
reason it cannot run here. Shared by `providers` (the registry) and `exported` (the converted-model peers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from bertfast.tools.workloads import Batch


class ProviderSkipped(Exception):
    """A provider cannot run here (not installed, unsupported dtype or device); the message says why."""


@dataclass
class Provider:
    """A ready-to-time provider: `fn(batch)` returns last_hidden_state (B, S, H) on the device."""

    name: str
    dtype: torch.dtype
    fn: Callable[[Batch], torch.Tensor]
    build_s: float = 0.0
    info: dict = field(default_factory=dict)
