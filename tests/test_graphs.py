"""The CUDA-graph path's CPU-testable half: token buckets, their edges, the static buffers' padded layout, and that
a forward run on a bucket's padded tokens gives the real tokens the eager result (torch backend in fp64 for every
family; the Triton interpreter bit for bit). Capture and replay themselves: tests/test_graphs_gpu.py."""

from __future__ import annotations

import pytest
import torch

import helpers.families as families
import modern_models
from bertfast import Encoder
from bertfast.backends import get_backend
from bertfast.backends.cuda.graphs import (LARGEST_BUCKET, TOKEN_BUCKETS, Bucket, GraphRunner, StaticTokens, bucket_for,
                                      token_buckets)
from bertfast.engine import Engine
from conftest import hf_bert, ragged_batch
from helpers.tokens import tokens_of


def test_token_buckets_hold_every_power_of_two():
    assert TOKEN_BUCKETS[:5] == (16, 32, 64, 128, 256)
    assert TOKEN_BUCKETS[5:9] == (320, 384, 448, 512)
    assert TOKEN_BUCKETS[-1] == LARGEST_BUCKET
    assert list(TOKEN_BUCKETS) == sorted(set(TOKEN_BUCKETS))
    for k in range(4, 15):
        assert 2 ** k in TOKEN_BUCKETS
    assert token_buckets(1000)[-1] == 896  # 768, 896 in the last octave below 1000


@pytest.mark.parametrize("T, expected", [(1, 16), (16, 16), (17, 32), (256, 256), (257, 320), (320, 320),
                                         (321, 384), (1025, 1280), (LARGEST_BUCKET, LARGEST_BUCKET)],
                         ids=lambda v: str(v))
def test_bucket_edges(T, expected):
    bucket = bucket_for(tokens_of([T]))
    assert bucket.tokens == expected
    # Never across the power of two above T: the kernels' tile configs are keyed by it.
    assert (T - 1).bit_length() == (bucket.tokens - 1).bit_length() or T <= 16


def test_over_the_largest_bucket_is_none():
    assert bucket_for(tokens_of([LARGEST_BUCKET, 1])) is None
    assert bucket_for(tokens_of([9, 9]), buckets=(16,)) is None


@pytest.mark.parametrize("lengths, expected", [
    ([17], Bucket(32, 2, 32, 0)),                  # one extra sequence of 15 tokens
    ([16] * 32, Bucket(512, 32, 16, 0)),            # exact: no extra sequence
    ([16] * 32 + [1], Bucket(640, 64, 16, 0)),     # 127 padding tokens in 8 sequences of <= 16
    ([1], Bucket(16, 2, 16, 0)),
    ([100, 3], Bucket(128, 4, 128, 0)),
], ids=["b1-17", "b32x16-exact", "b33-tail-split", "one-token", "b2-ragged"])
def test_bucket_sizes(lengths, expected):
    assert bucket_for(tokens_of(lengths)) == expected


def test_bias_models_bucket_the_width():
    assert bucket_for(tokens_of([5, 9], width=12, bias=True)).width == 16
    assert bucket_for(tokens_of([5, 9], width=12)).width == 0


@pytest.mark.parametrize("lengths", [[17], [16] * 32 + [1], [1], [100, 3], [7, 1, 40, 1]],
                         ids=["b1-17", "b33", "one-token", "b2-ragged", "with-1-token-rows"])
def test_static_fill_pads_with_sequences_of_their_own(lengths):
    tokens = tokens_of(lengths)
    bucket = bucket_for(tokens)
    static = StaticTokens(bucket, tokens, torch.device("cpu"))
    static.tokens.ids.fill_(7)  # stale ids of an earlier call stay in the tail
    static.fill(tokens)
    T, B = sum(lengths), len(lengths)
    s = static.tokens
    assert torch.equal(s.ids[:T], tokens.ids) and torch.equal(s.positions[:T], tokens.positions)
    assert bool((s.ids[T:] == 7).all())
    cu = s.cu_seqlens.tolist()
    assert cu[:B + 1] == tokens.cu_seqlens.tolist()
    assert cu[-1] == bucket.tokens and len(cu) == bucket.seqs + 1
    tail = [e - b for b, e in zip(cu[B:-1], cu[B + 1:])]
    assert all(0 <= n <= bucket.max_seqlen for n in tail)
    assert sum(tail) == bucket.tokens - T
    assert s.max_seqlen == bucket.max_seqlen >= max(lengths)


def test_a_smaller_call_after_a_larger_one_refills_the_tail():
    big, small = tokens_of([30, 2]), tokens_of([20])
    bucket = bucket_for(big)
    assert bucket_for(small).tokens == bucket.tokens
    static = StaticTokens(bucket_for(small), small, torch.device("cpu"))
    static.fill(big)
    static.fill(small)
    cu = static.tokens.cu_seqlens.tolist()
    assert cu[:2] == [0, 20] and cu[-1] == 32 and all(b <= e for b, e in zip(cu, cu[1:]))


def _compare(engine, inputs, atol, hidden=False):
    """engine.forward eagerly, then through a bucketing GraphRunner without capture: (runner, eager, bucketed)."""
    eager = engine.forward(*inputs, output_hidden_states=hidden)
    runner = GraphRunner(engine.encode, "cpu", capture=False)
    engine.run = runner
    bucketed = engine.forward(*inputs, output_hidden_states=hidden)
    for a, b in zip(eager, bucketed):
        if a is None:
            assert b is None
        elif isinstance(a, tuple):
            assert len(a) == len(b) and all(torch.allclose(x, y, rtol=0, atol=atol) for x, y in zip(a, b))
        else:
            assert torch.allclose(a, b, rtol=0, atol=atol), (a - b).abs().max()
    return runner


def _engine(model, backend, dtype):
    enc = Encoder.from_hf(model, backend=backend, dtype=dtype)
    return enc.engine


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "albert", "distilbert", "mpnet"])
def test_padded_bucket_gives_the_eager_result_every_family(family):
    model = families.build(family)
    kwargs, mask = families.batch_for(model, [23, 1, 9, 40])
    engine = _engine(model, "torch", torch.float64)
    inputs = (kwargs["input_ids"], mask, kwargs.get("token_type_ids"), None)
    runner = _compare(engine, inputs, 1e-12, hidden=True)
    assert runner._entries and not runner.captured


@pytest.mark.parametrize("name", ["modernbert", "nomic_bert", "gte"])
def test_padded_bucket_gives_the_eager_result_rotary(name):
    model = modern_models.build(name)
    ids, mask = modern_models.batch([37, 1, 12, 20])
    engine = _engine(model, "torch", torch.float64)
    _compare(engine, (ids, mask, None, None), 1e-12)


def test_hidden_states_and_plain_calls_get_buckets_of_their_own():
    model = hf_bert()
    ids, mask, types = ragged_batch([5, 11])
    engine = _engine(model, "torch", torch.float64)
    runner = _compare(engine, (ids, mask, types, None), 1e-12, hidden=True)
    engine.forward(ids, mask, types, None)
    assert sorted(h for _, h in runner._entries) == [False, True]


def test_triton_interpreter_bucket_is_bit_identical():
    from bertfast.kernels.triton import INTERPRET

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before bertfast.kernels.triton is imported (tests/conftest.py)")
    model = hf_bert(max_position_embeddings=48)
    ids, mask, types = ragged_batch([17, 1, 30])  # T = 48 -> bucket 64: an extra sequence of 16 tokens
    engine = _engine(model, "triton", torch.float32)
    assert not engine.graphs
    _compare(engine, (ids, mask, types, None), 0.0)


def test_graphs_default_off_where_nothing_can_be_captured():
    model = hf_bert()
    for backend in ("torch", "cpu"):
        try:
            enc = Encoder.from_hf(model, backend=backend)
        except ValueError as e:  # the cpu backend without its extension
            pytest.skip(str(e))
        assert not enc.engine.graphs and enc.engine.run == enc.engine.encode
    with pytest.raises(ValueError, match="graphs=True: backend 'torch' does not launch through CUDA graphs"):
        Encoder.from_hf(model, backend="torch", graphs=True)


def test_triton_on_cpu_refuses_graphs_with_the_reason():
    weights = Encoder.from_hf(hf_bert(), backend="torch").engine.weights
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Engine(weights, get_backend("triton", "cpu"), graphs=True)


def test_a_row_without_real_tokens_keeps_its_zeros():
    model = hf_bert()
    ids, mask, types = ragged_batch([6, 1, 1], seqlen=8)
    mask[1] = 0  # an empty sequence among real ones: cu_seqlens repeats a value
    engine = _engine(model, "torch", torch.float64)
    _compare(engine, (ids * mask, mask, types * mask, None), 1e-12)


@pytest.mark.parametrize("bias", [False, True])
def test_tokens_packed_on_the_host_move_with_their_dtypes(bias):
    """`engine.to_device` (what a GPU engine does with tokens packed on the host): every field and the indices
    arrive equal, in their own dtypes, each a contiguous view of the one buffer that made the one copy."""
    from bertfast.engine import to_device

    tokens = tokens_of([5, 1, 7], bias=bias)
    indices = torch.arange(13) * 2
    moved, moved_indices = to_device(tokens, indices, "cpu")
    assert torch.equal(moved_indices, indices) and moved_indices.dtype == torch.int64
    for name in ("ids", "positions", "types", "columns", "cu_seqlens"):
        a, b = getattr(tokens, name), getattr(moved, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b) and a.dtype == b.dtype and b.is_contiguous(), name
    assert (moved.max_seqlen, moved.width) == (tokens.max_seqlen, tokens.width)
    fields = [t for t in (*moved[:5], moved_indices) if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in fields}) == 1
