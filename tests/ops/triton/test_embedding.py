"""Embedding gather + LayerNorm (bertfast.kernels.triton.embedding) vs the reference."""

from __future__ import annotations

import pytest
import torch

from bertfast import reference as ref
from bertfast.backends.weights import EmbeddingWeights
from bertfast.kernels.triton import embedding as embedding_mod
from bertfast.kernels.triton.embedding import embeddings

from .conftest import DTYPES, NoLaunch, assert_matches_reference, rand

VOCAB, MAXPOS, TYPES = 50, 70, 2


def tables(H, dtype, with_types=True):
    return EmbeddingWeights(
        word=rand(VOCAB, H, dtype=dtype, seed=1),
        position=rand(MAXPOS, H, dtype=dtype, seed=2, scale=0.5),
        token_type=rand(TYPES, H, dtype=dtype, seed=3, scale=0.5, offset=2.0) if with_types else None,
        ln_weight=rand(H, dtype=dtype, seed=4, scale=0.2, offset=1.0),
        ln_bias=rand(H, dtype=dtype, seed=5, scale=0.2),
    )


def ids(T, seed=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (T,), generator=g).to(dtype), torch.randint(0, MAXPOS, (T,), generator=g).to(dtype),
            torch.randint(0, TYPES, (T,), generator=g).to(dtype))


def emb64(emb):
    return EmbeddingWeights(*(None if t is None else t.double() for t in
                              (emb.word, emb.position, emb.token_type, emb.ln_weight, emb.ln_bias)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [pytest.param(1, 96, id="T1-H96"), pytest.param(7, 26, id="T7-H26"),
                                 pytest.param(65, 384, id="T65-H384")])
def test_embed_matches_reference(T, H, dtype):
    emb = tables(H, dtype)
    i, p, t = ids(T)
    assert_matches_reference(embeddings(i, p, t, emb, 1e-12), ref.embeddings(i, p, t, emb, 1e-12),
                             ref.embeddings(i, p, t, emb64(emb), 1e-12), dtype, "embed")


def test_no_token_type_table_and_int32_ids():
    emb = tables(48, torch.float32, with_types=False)
    i, p, _ = ids(9, dtype=torch.int32)
    assert_matches_reference(embeddings(i, p, None, emb, 1e-5), ref.embeddings(i.long(), p.long(), None, emb, 1e-5),
                             ref.embeddings(i.long(), p.long(), None, emb64(emb), 1e-5), torch.float32, "no types")


def test_empty():
    i, p, t = ids(0)
    assert embeddings(i, p, t, tables(32, torch.float32), 1e-12).shape == (0, 32)


@pytest.mark.parametrize("case", ["id-out-of-range", "negative-position", "ids-2d", "ids-float", "length-mismatch",
                                  "types-missing", "table-dtype-fp64", "eps"])
def test_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(embedding_mod, "_embedding_kernel", NoLaunch())
    emb = tables(16, torch.float32)
    i, p, t = ids(5)
    args = dict(input_ids=i, position_ids=p, token_type_ids=t, emb=emb, eps=1e-12)
    if case == "id-out-of-range":
        args.update(input_ids=torch.tensor([0, 1, VOCAB, 2, 3]))
    elif case == "negative-position":
        args.update(position_ids=torch.tensor([0, -1, 2, 3, 4]))
    elif case == "ids-2d":
        args.update(input_ids=i[None])
    elif case == "ids-float":
        args.update(input_ids=i.float())
    elif case == "length-mismatch":
        args.update(position_ids=p[:4])
    elif case == "types-missing":
        args.update(token_type_ids=None)
    elif case == "table-dtype-fp64":
        args.update(emb=emb64(emb))
    elif case == "eps":
        args.update(eps=-1.0)
    with pytest.raises(ValueError, match="embeddings: "):
        embeddings(**args)


def rotary_tables(H, dtype, with_types):
    """A rotary model's tables: no position table (ModernBERT has no token types either)."""
    emb = tables(H, dtype, with_types)
    return EmbeddingWeights(emb.word, None, emb.token_type, emb.ln_weight, emb.ln_bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_types", [pytest.param(True, id="types"), pytest.param(False, id="no-types")])
@pytest.mark.parametrize("T,H", [pytest.param(1, 96, id="T1-H96"), pytest.param(65, 80, id="T65-H80")])
def test_no_position_table(T, H, with_types, dtype):
    emb = rotary_tables(H, dtype, with_types)
    i, p, t = ids(T, seed=3)
    t = t if with_types else None
    ours = embeddings(i, p, t, emb, 1e-5)
    assert_matches_reference(ours, ref.embeddings(i, p, t, emb, 1e-5), ref.embeddings(i, p, t, emb64(emb), 1e-5), dtype,
                             "no positions")
    # Without a table the position ids are not read: any values, or none at all.
    assert torch.equal(embeddings(i, None, t, emb, 1e-5), ours)
    assert torch.equal(embeddings(i, p + 10 ** 6, t, emb, 1e-5), ours)


def test_position_ids_required_with_a_table(monkeypatch):
    monkeypatch.setattr(embedding_mod, "_embedding_kernel", NoLaunch())
    i, _, t = ids(5)
    with pytest.raises(ValueError, match="embeddings: .*position_ids is required"):
        embeddings(i, None, t, tables(16, torch.float32), 1e-12)
