"""LoRA adapters on task models: an adapter's `modules_to_save` tensors (`Adapter.heads`) as its own copy of the task
head, run on that adapter's rows only.

`adapted_head` builds the copy once, at load: every saved tensor must be one the head reads, in the head's shape,
else `LoadError` naming it; it replaces the base tensor (cast to the head's dtype and device) and every other tensor
is shared with the base head. A forward with per-row adapters groups its rows by head (`run_heads`): rows on the base
model, or on an adapter that saved no head tensor, run the base head. Sequence-level steps run a row at a time and
per-token steps a sequence at a time, so a row's outputs depend on its own tokens, adapter and head alone: the same
bits alone and in any mixed batch.
"""

from __future__ import annotations

import os

import torch

from .adapters_peft import SAVED_PREFIX, PeftFiles
from .loading import LoadError


def adapted_head(head, tensors: dict[str, torch.Tensor], where: str, architecture: str, lora: dict | None = None):
    """`head` (a `heads.Head`) with `tensors` (name in the task model -> tensor, `Adapter.heads`) in place of its own,
    and lora (module -> (A, B with the scale), `Adapter.head_lora`) merged into its linears (W + B A in fp32, as
    PEFT's merge: a head runs once per row group, so its own copy costs nothing per token); raises LoadError for a
    name the head does not read or a shape other than the head's."""
    own = head.tensors
    tensors = dict(tensors)
    for module, (A, B) in sorted((lora or {}).items()):
        name = module + ".weight"
        if name not in own or name in tensors or tuple(own[name].shape) != (B.shape[0], A.shape[1]):
            raise LoadError(f"{where}: LoRA of {module!r} ({B.shape[0]} x {A.shape[1]}) does not fit a linear the "
                            f"{architecture} head reads ({', '.join(sorted(own))})")
        tensors[name] = own[name].float() + B.to(own[name].device) @ A.to(own[name].device)
    for name, t in sorted(tensors.items()):
        if name not in own:
            raise LoadError(f"{where}: tensor {SAVED_PREFIX + name!r} (modules_to_save) is not one the {architecture} "
                            f"head reads ({', '.join(sorted(own))})")
        if tuple(t.shape) != tuple(own[name].shape):
            raise LoadError(f"{where}: tensor {SAVED_PREFIX + name!r} (modules_to_save) has shape {tuple(t.shape)}, "
                            f"the {architecture} head's {name!r} has {tuple(own[name].shape)}: the adapter was "
                            "trained for another head (num_labels?)")
    swap = {id(own[n]): t.to(device=own[n].device, dtype=own[n].dtype).contiguous() for n, t in tensors.items()}
    branches = {field: (source, [tuple(swap.get(id(x), x) if torch.is_tensor(x) else x for x in step)
                                 for step in steps])
                for field, (source, steps) in head.branches.items()}
    return type(head)(branches, head.eps, {n: swap.get(id(t), t) for n, t in own.items()})


def by_head(heads: list, run, device):
    """heads: one head per row; run(head, idx) -> a tensor, or a dict of them, for the rows idx (an index tensor on
    `device`; None when every row has the same head: all rows) -> the same over all rows, each row's from its own
    head (rows grouped by head, one run per group)."""
    groups: dict[int, tuple] = {}
    for i, head in enumerate(heads):
        groups.setdefault(id(head), (head, []))[1].append(i)
    if len(groups) == 1:
        return run(heads[0], None)
    out = {}
    for head, rows in groups.values():
        idx = torch.tensor(rows, device=device)
        part = run(head, idx)
        for field, t in (part.items() if isinstance(part, dict) else [(None, part)]):
            if field not in out:
                out[field] = t.new_zeros((len(heads), *t.shape[1:]))
            out[field][idx] = t
    return out[None] if None in out else out


def run_heads(heads: list, last: torch.Tensor, pooled: torch.Tensor | None, mask: torch.Tensor) -> dict:
    """heads: one `heads.Head` per row; last (B, S, H), pooled (B, H) or None, mask (B, S) 0/1 -> the fields as
    `Head.forward` returns them, each row's from its own head (`by_head`)."""
    def run(head, idx):
        if idx is None:
            return head(last, pooled, mask)
        return head(last[idx], None if pooled is None else pooled[idx], mask[idx])
    return by_head(heads, run, last.device)


def per_choice(adapter_ids, examples: int, choices: int):
    """Multiple choice: adapter_ids (one name or None per example) -> one per flattened (example, choice) row."""
    if adapter_ids is None or isinstance(adapter_ids, str) or not hasattr(adapter_ids, "__len__"):
        return adapter_ids  # None, or a malformed value the Encoder's check reports
    if len(adapter_ids) != examples:
        raise ValueError(f"adapter_ids has {len(adapter_ids)} entries for {examples} examples: give one name or None "
                         "per example (its choices share it)")
    return [a for a in adapter_ids for _ in range(choices)]


class TaskAdapters:
    """`TaskModel`'s LoRA adapters: the encoder's (`Encoder.load_adapter`: the LoRA factors, per row) and each
    adapter's head (`adapted_head`), chosen per row with them. Needs `encoder`, `head`, `architecture` and an
    `_adapter_heads` dict (adapter name -> its Head, for adapters that saved head tensors)."""

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters, in loading order."""
        return self.encoder.adapters

    @property
    def default_adapter(self) -> str | None:
        """The adapter (encoder and head) of every row of a call naming none; as `Encoder.default_adapter`."""
        return self.encoder.default_adapter

    @default_adapter.setter
    def default_adapter(self, name: str | None) -> None:
        self.encoder.default_adapter = name

    def load_adapter(self, name: str, path) -> None:
        """Load the PEFT LoRA directory `path` (or an `adapters_peft.PeftFiles`) under `name`: its LoRA factors into
        the encoder, its modules_to_save tensors as this adapter's copy of the head (an adapter without any runs the
        base head). Raises what `Encoder.load_adapter` raises, and LoadError for a saved tensor the head does not read
        or whose shape differs from the head's (num_labels); nothing stays loaded after an error."""
        self.encoder.load_adapter(name, path)
        try:
            adapter = self.encoder._adapter(name)
            if adapter.heads or adapter.head_lora:
                where = path.path if isinstance(path, PeftFiles) else os.fspath(path)
                self._adapter_heads[name] = adapted_head(self.head, adapter.heads, where, self.architecture,
                                                         adapter.head_lora)
        except BaseException:
            self.encoder.unload_adapter(name)
            raise

    def unload_adapter(self, name: str) -> None:
        """Forget `name` and its head; raises as `Encoder.unload_adapter`."""
        self.encoder.unload_adapter(name)
        self._adapter_heads.pop(name, None)

    def _row_heads(self, adapter_ids, rows: int) -> list | None:
        """The head of each of `rows` rows for a call's adapter_ids (checked by the encoder already), or None for a
        call without adapters (no adapter_ids, no default_adapter): the base head's batched path, as before."""
        if adapter_ids is None:
            if self.encoder.default_adapter is None:
                return None
            adapter_ids = [self.encoder.default_adapter] * rows
        return [self.head if a is None else self._adapter_heads.get(a, self.head) for a in adapter_ids]


__all__ = ["TaskAdapters", "adapted_head", "by_head", "run_heads", "per_choice"]
