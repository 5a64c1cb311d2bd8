"""The model every `bertfast bench` provider runs, and the reference they are checked against.

`Source.reference` is the untouched fp32 Hugging Face model (eager attention): never exported,
compiled or cast; providers work on deep copies (`hf_copy`). `load_source` builds it from a
checkpoint directory or from random weights of a named config, and keeps its own arguments in
`Source.spec` so that a worker process can rebuild the same source (docs/bench-method.md#validation,
#isolation).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from bertfast.config import ModelConfig
from bertfast.tools import workloads
from bertfast.tools.workloads import Batch


@dataclass
class Source:
    """The model all providers run. `reference` is fp32, eager attention, and never exported,
    compiled or cast: providers work on deep copies of it."""

    label: str
    config: object  # bertfast.ModelConfig
    reference: torch.nn.Module
    model_dir: str | None = None
    device: str = "cpu"
    spec: dict | None = None  # load_source's arguments: how a worker process rebuilds this source

    def hf_copy(self, attn_implementation: str, dtype: torch.dtype) -> torch.nn.Module:
        model = copy.deepcopy(self.reference)
        model.set_attn_implementation(attn_implementation)
        return model.to(device=self.device, dtype=dtype).eval()


def load_source(model_dir: str | None = None, config_name: str | None = None, device: str = "cpu",
                seed: int = 0, label: str | None = None) -> Source:
    """The reference model: a checkpoint directory, or random weights of a named config."""
    spec = {"model_dir": model_dir, "config_name": config_name, "device": device, "seed": seed, "label": label}
    if config_name is not None:
        model = workloads.random_hf_model(config_name, seed, attn_implementation="eager")
        return Source(f"random {config_name} (seed {seed})", workloads.model_config(config_name),
                      model.to(device), None, device, spec)
    from transformers import AutoModel

    if not os.path.isdir(model_dir):
        raise ValueError(f"--model {model_dir}: not a directory")
    model = AutoModel.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    return Source(label or _dir_label(model_dir), ModelConfig.from_json(model_dir), model.eval().to(device),
                  model_dir, device, spec)


def _dir_label(model_dir: str) -> str:
    # Packaged checkpoints often sit in a directory called "model": name the parent instead.
    parts = [p for p in os.path.normpath(os.path.abspath(model_dir)).split(os.sep) if p]
    while len(parts) > 1 and parts[-1] in ("model", "snapshots") or (parts and len(parts[-1]) == 40
                                                                       and parts[-1].isalnum()):
        parts.pop()
    return parts[-1] if parts else model_dir


def reference_output(source: Source, batch: Batch) -> torch.Tensor:
    """last_hidden_state (B, S, H) fp32 of the untouched fp32 eager reference model."""
    with torch.inference_mode():
        return source.reference(**batch.inputs()).last_hidden_state.float()
