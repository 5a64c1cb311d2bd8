"""What a forward returns: `EncoderOutput`, transformers' ModelOutput shape (attributes, `out[0]`, `out["..."]`)."""

from __future__ import annotations

import torch


class EncoderOutput:
    """Like transformers' ModelOutput: attributes, integer and key indexing over non-None fields."""

    _fields = ("last_hidden_state", "pooler_output", "hidden_states")

    def __init__(self, last_hidden_state, pooler_output=None, hidden_states=None):
        self.last_hidden_state = last_hidden_state
        self.pooler_output = pooler_output
        self.hidden_states = hidden_states

    def to_tuple(self):
        return tuple(getattr(self, f) for f in self._fields if getattr(self, f) is not None)

    def keys(self):
        return [f for f in self._fields if getattr(self, f) is not None]

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]

    def __iter__(self):
        return iter(self.to_tuple())

    def __len__(self):
        return len(self.to_tuple())

    def __repr__(self):
        parts = ", ".join(f"{k}={tuple(getattr(self, k).shape) if torch.is_tensor(getattr(self, k)) else '...'}"
                          for k in self.keys())
        return f"{type(self).__name__}({parts})"
