"""Texts for the sentence-embedding tests and their parity measure.

`sentences` gives deterministic texts of varied lengths (accents, CJK, emoji, punctuation), a few of them longer
than a model's limit; `max_diff` is the largest absolute difference over every embedding coordinate.
"""

from __future__ import annotations

import random

import torch

WORDS = ("the a of cat dog model engine runs fast slow embedding vector sentence token padding batch "
         "Paris Zürich naïve café 42 3.14 (see below) — don't e-mail well-known GPU CPU 東京 数据 🙂 "
         "attention layer norm quickly jumps over lazy river bank money interest rates").split()


def sentences(n, seed=0, long_every=25, long_words=(250, 420)):
    """n deterministic texts of varied lengths; every long_every-th one longer than 256 tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(*long_words) if i % long_every == 5 else rng.choice((1, 2, 3, 5, 8, 13, 21, 34, 55))
        text = " ".join(rng.choice(WORDS) for _ in range(k))
        out.append(text.capitalize() + rng.choice((".", "?", "!", "")))
    return out


def max_diff(a, b):
    """max |a - b| over every coordinate, in fp64."""
    return (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()
