"""Comparisons of a task model's outputs with transformers' own, field by field, at <= 1e-5 relative over real
positions (padded positions are never compared)."""

from __future__ import annotations

from conftest import rel_err


def check_against(ours, ref, mask):
    """Every transformers field at <= 1e-5 relative, real positions only; per-token fields are 0 at
    padded positions; tuple order starts like transformers' (no loss, no attentions)."""
    keys = list(ref.keys())
    assert list(ours.keys())[:len(keys)] == keys
    for i, key in enumerate(keys):
        a, b = ours[key], ref[key]
        assert ours[i] is a
        if isinstance(b, tuple):  # hidden_states
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert rel_err(x, y, mask) <= 1e-5, key
        elif b.dim() >= 2 and b.shape[:2] == mask.shape:  # per token
            assert a.shape == b.shape, key
            assert rel_err(a, b, mask) <= 1e-5, key
            assert not a[~mask.bool()].any(), f"{key} is not 0 at padded positions"
        else:
            assert a.shape == b.shape, key
            assert rel_err(a, b) <= 1e-5, key
    assert rel_err(ours.last_hidden_state, ref.hidden_states[-1], mask) <= 1e-5


def compare(ours, ref, mask):
    """Every field of `ref` at <= 1e-5 relative (hidden states one by one), per-token fields over real positions
    only, the others flattened; `ours` may hold more fields."""
    for key in ref.keys():
        a, b = ours[key], ref[key]
        if isinstance(b, tuple):
            for x, y in zip(a, b, strict=True):
                assert rel_err(x, y, mask) <= 1e-5, key
        elif b.dim() >= 2 and b.shape[:2] == mask.shape:  # per-token output: real positions only
            assert rel_err(a, b, mask) <= 1e-5, key
        else:
            assert rel_err(a.reshape(-1), b.reshape(-1)) <= 1e-5, key
