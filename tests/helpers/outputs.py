"""Comparisons of a task model's outputs with transformers' own, field by field, at <= 1e-5 relative over real
positions (padded positions are never compared)."""

from __future__ import annotations

from conftest import rel_err


def compare(ours, ref, mask, strict: bool = False):
    """Every field of `ref` at <= 1e-5 relative (hidden states one by one), per-token fields over real positions
    only, the others whole; `ours` may hold more fields. strict: also transformers' field order (`ours` starts
    with `ref`'s keys, each reachable by position), the same shapes, per-token fields 0 at padded positions, and
    last_hidden_state equal to the last hidden state."""
    keys = list(ref.keys())
    if strict:
        assert list(ours.keys())[:len(keys)] == keys
    for i, key in enumerate(keys):
        a, b = ours[key], ref[key]
        if strict:
            assert ours[i] is a, key
        if isinstance(b, tuple):  # hidden_states
            assert len(a) == len(b), key
            for x, y in zip(a, b):
                assert rel_err(x, y, mask) <= 1e-5, key
            continue
        if strict:
            assert a.shape == b.shape, key
        if b.dim() >= 2 and b.shape[:2] == mask.shape:  # per token: real positions only
            assert rel_err(a, b, mask) <= 1e-5, key
            if strict:
                assert not a[~mask.bool()].any(), f"{key} is not 0 at padded positions"
        else:
            assert rel_err(a.reshape(-1), b.reshape(-1)) <= 1e-5, key
    if strict:
        assert rel_err(ours.last_hidden_state, ref.hidden_states[-1], mask) <= 1e-5


def check_against(ours, ref, mask):
    """`compare(ours, ref, mask, strict=True)`: the task heads' full check."""
    compare(ours, ref, mask, strict=True)
