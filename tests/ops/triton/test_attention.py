"""Flash attention forward (bertfast.kernels.triton.attention), varlen and padded, sliding windows and the
relative position bias, vs the reference."""

from __future__ import annotations

import math

import pytest
import torch

from bertfast import reference as ref
from bertfast import relative
from bertfast.backends import AttentionBias
from bertfast.kernels.triton import attention as attention_mod
from bertfast.kernels.triton.attention import attention_padded, attention_varlen

from .conftest import DTYPES, NoLaunch, assert_matches_reference, f64, rand

# (cu_seqlens, head_dim): ragged with length-1 rows, an empty sequence, lengths 63/65 and 129
# (tails of every block), head dims 32/64/80/128 and the non-powers of two 26 and 48.
VARLEN_CASES = [
    pytest.param([0, 1, 17, 80, 81], 32, id="cu0-1-17-80-81-d32"),
    pytest.param([0, 7, 7, 70], 26, id="cu0-7-7-70-empty-d26"),
    pytest.param([0, 63, 128], 64, id="L63-65-d64"),
    pytest.param([0, 129], 80, id="L129-d80"),
    pytest.param([0, 1, 8], 128, id="L1-7-d128"),
    pytest.param([0, 65, 66, 66], 48, id="L65-1-0-d48"),
]
HEADS = 2


def packed(cu, d, dtype, seed=0, scale=1.0):
    T = cu[-1]
    q = rand(T, HEADS, d, dtype=dtype, seed=seed, scale=scale)
    k = rand(T, HEADS, d, dtype=dtype, seed=seed + 1, scale=scale)
    v = rand(T, HEADS, d, dtype=dtype, seed=seed + 2)
    return q, k, v, torch.tensor(cu, dtype=torch.int32)


def max_len(cu):
    return max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu,d", VARLEN_CASES)
def test_varlen_matches_per_sequence_loop(cu, d, dtype):
    q, k, v, cu_t = packed(cu, d, dtype)
    scale = 1 / math.sqrt(d)
    ours = attention_varlen(q, k, v, cu_t, max_len(cu), scale)
    assert ours.shape == (cu[-1], HEADS * d)
    assert_matches_reference(ours, ref.attention_loop(q, k, v, cu_t, scale),
                             ref.attention_loop(*f64(q, k, v), cu_t, scale), dtype, "varlen")


def test_varlen_matches_packed_reference_and_larger_max_seqlen():
    # reference.attention (the packed op) agrees, and an over-estimated max_seqlen changes nothing.
    cu = [0, 1, 17, 80, 81]
    q, k, v, cu_t = packed(cu, 32, torch.float32)
    ours = attention_varlen(q, k, v, cu_t, 63, 0.2)
    assert_matches_reference(ours, ref.attention(q, k, v, cu_t, 63, 0.2),
                             ref.attention(*f64(q, k, v), cu_t, 63, 0.2), torch.float32, "packed reference")
    assert torch.equal(attention_varlen(q, k, v, cu_t, 200, 0.2), ours)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_scores_stay_finite(dtype):
    # Scores of several hundred: exp overflows unless the online softmax rescales. Rounding the
    # scores alone costs ~1e-4 here (the fp32 reference misses the table too): 2x-its-error only.
    cu = [0, 40, 97]
    q, k, v, cu_t = packed(cu, 32, dtype, scale=6.0)
    ours = attention_varlen(q, k, v, cu_t, 57, 1.0)
    assert_matches_reference(ours, ref.attention_loop(q, k, v, cu_t, 1.0),
                             ref.attention_loop(*f64(q, k, v), cu_t, 1.0), dtype, "large scores", table=False)


def test_sequence_alone_equals_sequence_in_batch():
    cu = [0, 5, 38, 39, 70]
    q, k, v, cu_t = packed(cu, 48, torch.float32)
    batch = attention_varlen(q, k, v, cu_t, 33, 0.3)
    s, e = 5, 38
    alone = attention_varlen(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32), e - s, 0.3)
    assert torch.equal(alone, batch[s:e])


def test_noncontiguous_varlen():
    # q, k, v as the column blocks of a (T, 3, heads, d) projection output (reference.qkv's views).
    cu = [0, 9, 30]
    fused = rand(30, 3, HEADS, 26)
    q, k, v = fused[:, 0], fused[:, 1], fused[:, 2]
    assert not q.is_contiguous()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    assert_matches_reference(attention_varlen(q, k, v, cu_t, 21, 0.2), ref.attention_loop(q, k, v, cu_t, 0.2),
                             ref.attention_loop(*f64(q, k, v), cu_t, 0.2), torch.float32, "noncontiguous")


def test_all_sequences_empty():
    q, k, v, cu_t = packed([0, 0, 0], 32, torch.float32)
    assert attention_varlen(q, k, v, cu_t, 0, 0.1).shape == (0, HEADS * 32)


def padded_inputs(B, S, d, dtype, seed=0):
    # (B, heads, S, d) views of (B, S, heads, d) buffers, the layout a padded projection gives.
    q, k, v = (rand(B, S, HEADS, d, dtype=dtype, seed=seed + i).transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_with_key_mask(dtype):
    # Rows: all real; all but one padded; fully masked (Hugging Face: uniform over all keys); 63 real.
    B, S, d = 4, 65, 48
    q, k, v = padded_inputs(B, S, d, dtype)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0] = True
    mask[1, 0] = True
    mask[3, :63] = True
    scale = 1 / math.sqrt(d)
    ours = attention_padded(q, k, v, mask, scale)
    assert_matches_reference(ours, ref.attention_padded(q, k, v, mask, scale),
                             ref.attention_padded(*f64(q, k, v), mask, scale), dtype, "padded")
    # The fully masked row is the mean of V, finite.
    torch.testing.assert_close(ours[2].double(), f64(v)[2].mean(1, keepdim=True).expand(HEADS, S, d),
                               atol=2e-3 if dtype == torch.float16 else 1e-6, rtol=0)


def test_padded_integer_mask_and_no_mask():
    q, k, v = padded_inputs(2, 7, 32, torch.float32)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    assert_matches_reference(attention_padded(q, k, v, mask, 0.2), ref.attention_padded(q, k, v, mask, 0.2),
                             ref.attention_padded(*f64(q, k, v), mask, 0.2), torch.float32, "int mask")
    assert_matches_reference(attention_padded(q, k, v, None, 0.2), ref.attention_padded(q, k, v, None, 0.2),
                             ref.attention_padded(*f64(q, k, v), None, 0.2), torch.float32, "no mask")


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_and_varlen_agree(dtype):
    lengths = [5, 1, 17, 65]
    B, S, d = len(lengths), max(lengths), 32
    q, k, v = padded_inputs(B, S, d, dtype, seed=3)
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    padded = attention_padded(q, k, v, mask, 0.25).transpose(1, 2)  # (B, S, heads, d)
    pack = lambda t: t.transpose(1, 2)[mask]  # (T, heads, d), real tokens only  # noqa: E731
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    varlen = attention_varlen(pack(q), pack(k), pack(v), cu, S, 0.25)
    # Compared on real query positions only; padded queries have no varlen counterpart.
    torch.testing.assert_close(varlen, padded[mask].reshape(-1, HEADS * d), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["cu-int64", "cu-2d", "cu-end", "cu-start", "max-seqlen-small",
                                  "max-seqlen-float", "shape-mismatch", "dtype-fp64", "mixed-dtype", "device-meta"])
def test_varlen_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(attention_mod, "_attention_kernel", NoLaunch())
    q, k, v, cu_t = packed([0, 3, 8], 32, torch.float32)
    args = dict(q=q, k=k, v=v, cu_seqlens=cu_t, max_seqlen=5, scale=0.1)
    if case == "cu-int64":
        args.update(cu_seqlens=cu_t.long())
    elif case == "cu-2d":
        args.update(cu_seqlens=cu_t[None])
    elif case == "cu-end":
        args.update(cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32))
    elif case == "cu-start":
        args.update(cu_seqlens=torch.tensor([1, 3, 8], dtype=torch.int32))
    elif case == "max-seqlen-small":
        args.update(max_seqlen=4)
    elif case == "max-seqlen-float":
        args.update(max_seqlen=5.0)
    elif case == "shape-mismatch":
        args.update(k=k[:, :1])
    elif case == "dtype-fp64":
        args.update(q=q.double(), k=k.double(), v=v.double())
    elif case == "mixed-dtype":
        args.update(v=v.half())
    elif case == "device-meta":
        args.update(q=q.to("meta"), k=k.to("meta"), v=v.to("meta"), cu_seqlens=cu_t.to("meta"))
    with pytest.raises(ValueError, match="attention: "):
        attention_varlen(**args)


@pytest.mark.parametrize("case", ["mask-shape", "mask-complex", "3d-input", "device-mixed"])
def test_padded_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(attention_mod, "_attention_kernel", NoLaunch())
    q, k, v = padded_inputs(2, 5, 16, torch.float32)
    args = dict(q=q, k=k, v=v, key_mask=torch.ones(2, 5, dtype=torch.bool), scale=0.1)
    if case == "mask-shape":
        args.update(key_mask=torch.ones(2, 6, dtype=torch.bool))
    elif case == "mask-complex":
        args.update(key_mask=torch.ones(2, 5, dtype=torch.complex64))
    elif case == "3d-input":
        args.update(q=q[0], k=k[0], v=v[0])
    elif case == "device-mixed":
        args.update(key_mask=torch.ones(2, 5, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="attention_padded: "):
        attention_padded(**args)


def test_config_filter_fits_the_problem():
    # The compiled-mode autotune list (a single config under the interpreter) and its filter.
    prune, every = attention_mod._prune_configs, attention_mod._CONFIGS
    f16, f32 = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float32)
    assert prune(every, {"seqlen_bucket": 512, "q_ptr": f16}, BLOCK_D=64) == attention_mod.MMA_CONFIGS
    short = prune(every, {"seqlen_bucket": 16, "q_ptr": f16}, BLOCK_D=64)
    assert short and all(c.kwargs["BLOCK_M"] <= 64 for c in short)
    # d = 128: no 128 x 64 tiles (they spill), and exact fp32 only gets the FMA tiles.
    wide = prune(every, {"seqlen_bucket": 512, "q_ptr": f16}, BLOCK_D=128)
    assert wide and not any(c.kwargs["BLOCK_M"] == 128 and c.kwargs["BLOCK_N"] == 64 for c in wide)
    assert prune(every, {"seqlen_bucket": 512, "q_ptr": f32}, BLOCK_D=128) == attention_mod.FMA_CONFIGS
    assert len(attention_mod._attention_kernel.configs) == 1  # this suite runs under TRITON_INTERPRET=1


def test_every_config_of_a_dtype_family_steps_keys_alike():
    # Batch invariance: the autotuner keys on the batch's longest sequence, so whatever it picks for a row alone
    # and for the same row in a longer batch must cut that row's keys into the same steps (one BLOCK_N per
    # family) and reduce its score rows in the same order (fp32: one tile shape).
    assert len({c.kwargs["BLOCK_N"] for c in attention_mod.MMA_CONFIGS}) == 1
    assert len(attention_mod.FMA_CONFIGS) == 1
    f16 = torch.empty(0, dtype=torch.float16)
    for bucket in (16, 32, 64, 128, 512):
        for d in (32, 64, 128):
            kept = attention_mod._prune_configs(attention_mod._CONFIGS, {"seqlen_bucket": bucket, "q_ptr": f16},
                                                BLOCK_D=d)
            assert kept and {c.kwargs["BLOCK_N"] for c in kept} == {attention_mod.MMA_CONFIGS[0].kwargs["BLOCK_N"]}


# ---- sliding-window attention (varlen) ----

# (cu_seqlens, head_dim, window): 1-token rows; sequences of exactly window + 1 tokens (the last key at the
# boundary of the first row) and window + 2 (one past it); lengths 127/129; windows at and beside the
# interpreter's key-tile edges (32); a window larger than every sequence.
WINDOW_CASES = [
    pytest.param([0, 1, 17, 80, 81], 32, 8, id="cu0-1-17-80-81-d32-w8"),
    pytest.param([0, 9, 19, 20], 64, 8, id="L9-10-1-d64-w8-boundary"),
    pytest.param([0, 127, 256], 80, 32, id="L127-129-d80-w32"),
    pytest.param([0, 129], 32, 31, id="L129-d32-w31"),
    pytest.param([0, 100, 101], 64, 33, id="L100-1-d64-w33"),
    pytest.param([0, 7, 7, 30], 26, 64, id="L7-0-23-d26-w64-wider"),
]


def window_inputs(cu, d, dtype, seed=0):
    return packed(cu, d, dtype, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu,d,window", WINDOW_CASES)
def test_window_matches_per_sequence_loop(cu, d, window, dtype):
    q, k, v, cu_t = window_inputs(cu, d, dtype)
    scale = 1 / math.sqrt(d)
    ours = attention_varlen(q, k, v, cu_t, max_len(cu), scale, window=window)
    assert ours.shape == (cu[-1], HEADS * d)
    assert_matches_reference(ours, ref.attention_loop(q, k, v, cu_t, scale, window=window),
                             ref.attention_loop(*f64(q, k, v), cu_t, scale, window=window), dtype, "window")


def test_window_matches_packed_reference():
    cu = [0, 1, 17, 80, 81]
    q, k, v, cu_t = window_inputs(cu, 32, torch.float32, seed=4)
    ours = attention_varlen(q, k, v, cu_t, 63, 0.2, window=5)
    assert_matches_reference(ours, ref.attention(q, k, v, cu_t, 63, 0.2, window=5),
                             ref.attention(*f64(q, k, v), cu_t, 63, 0.2, window=5), torch.float32, "packed window")


def test_window_one_sees_neighbours_only():
    # window = 1: each row mixes itself and its two neighbours; a 1-token sequence returns its own v.
    cu = [0, 1, 40]
    q, k, v, cu_t = window_inputs(cu, 32, torch.float32, seed=5)
    ours = attention_varlen(q, k, v, cu_t, 39, 0.3, window=1)
    assert_matches_reference(ours, ref.attention_loop(q, k, v, cu_t, 0.3, window=1),
                             ref.attention_loop(*f64(q, k, v), cu_t, 0.3, window=1), torch.float32, "w1")
    torch.testing.assert_close(ours[0], v[0].reshape(-1), atol=0, rtol=0)


def test_window_wider_than_the_sequences_is_plain_attention():
    cu = [0, 40, 97]
    q, k, v, cu_t = window_inputs(cu, 32, torch.float32, seed=6)
    plain = attention_varlen(q, k, v, cu_t, 57, 0.2)
    # window = max_seqlen - 1 still takes the windowed kernel and hides nothing; larger ones skip it.
    torch.testing.assert_close(attention_varlen(q, k, v, cu_t, 57, 0.2, window=56), plain, atol=1e-6, rtol=1e-6)
    assert torch.equal(attention_varlen(q, k, v, cu_t, 57, 0.2, window=57), plain)


def test_window_sequence_alone_equals_sequence_in_batch():
    cu = [0, 5, 105, 106]
    q, k, v, cu_t = window_inputs(cu, 32, torch.float32, seed=7)
    batch = attention_varlen(q, k, v, cu_t, 100, 0.2, window=16)
    s, e = 5, 105
    alone = attention_varlen(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], dtype=torch.int32), e - s, 0.2,
                             window=16)
    assert torch.equal(alone, batch[s:e])


def test_window_skips_key_tiles_outside_it():
    # NaN in v at one key: a visited tile spreads it through p @ v (even where p = 0), so the query tiles
    # whose rows stay finite are exactly those whose loop bounds skipped the key's tile.
    config = attention_mod._attention_kernel.configs[0].kwargs
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    S, window, poison = 4 * block_m, 8, 3 * block_m + 8
    q, k, v, cu_t = window_inputs([0, S], 32, torch.float32, seed=8)
    v[poison] = float("nan")
    out = attention_varlen(q, k, v, cu_t, S, 0.2, window=window)
    tile = poison // block_n * block_n
    for m0 in range(0, S, block_m):
        lo, hi = max(m0 - window, 0) // block_n * block_n, min(S, m0 + block_m + window)
        visited = lo <= tile < hi
        assert torch.isnan(out[m0:m0 + block_m]).any().item() == visited, (m0, visited)
    assert torch.isfinite(out[:2 * block_m]).all()


@pytest.mark.parametrize("window", [-1, 2.0, True])
def test_window_bad_value_raises_before_launch(window, monkeypatch):
    monkeypatch.setattr(attention_mod, "_attention_kernel", NoLaunch())
    q, k, v, cu_t = packed([0, 3, 8], 32, torch.float32)
    with pytest.raises(ValueError, match="attention: window"):
        attention_varlen(q, k, v, cu_t, 5, 0.1, window=window)


# ---- relative position bias (MPNet), varlen ----


def relative_bias(cu, heads=HEADS, seed=0, holes=False):
    """An AttentionBias as the engine builds it: a per-distance table for the padded width and each token's
    column in the padded batch (holes: a gap of masked columns inside every sequence longer than 3)."""
    g = torch.Generator().manual_seed(seed)
    width = max_len(cu) + (3 if holes else 0)
    table = relative.bias_table(torch.randn(32, heads, generator=g), max(width, 1))
    columns = []
    for n in (b - a for a, b in zip(cu[:-1], cu[1:])):
        cols = list(range(n))
        columns += [c + 3 if holes and n > 3 and c >= 2 else c for c in cols]
    return AttentionBias(table, torch.tensor(columns, dtype=torch.int32))


BIAS_CASES = [
    pytest.param([0, 1, 17, 80, 81], 32, False, 0, id="cu0-1-17-80-81-d32"),
    pytest.param([0, 129, 130], 64, False, 0, id="L129-1-d64"),
    pytest.param([0, 7, 7, 70], 80, True, 0, id="L7-0-63-d80-holes"),
    pytest.param([0, 127, 150], 32, False, 16, id="L127-23-d32-w16"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cu,d,holes,window", BIAS_CASES)
def test_bias_matches_per_sequence_loop(cu, d, holes, window, dtype):
    q, k, v, cu_t = packed(cu, d, dtype, seed=9)
    bias = relative_bias(cu, holes=holes)
    scale = 1 / math.sqrt(d)
    ours = attention_varlen(q, k, v, cu_t, max_len(cu), scale, window=window, bias=bias)
    assert_matches_reference(ours, ref.attention_loop(q, k, v, cu_t, scale, bias=bias, window=window),
                             ref.attention_loop(*f64(q, k, v), cu_t, scale, bias=bias, window=window), dtype, "bias")


def test_bias_matches_packed_reference():
    cu = [0, 5, 38, 39]
    q, k, v, cu_t = packed(cu, 32, torch.float32, seed=10)
    bias = relative_bias(cu, seed=1)
    ours = attention_varlen(q, k, v, cu_t, 33, 0.2, bias=bias)
    assert_matches_reference(ours, ref.attention(q, k, v, cu_t, 33, 0.2, bias=bias),
                             ref.attention(*f64(q, k, v), cu_t, 33, 0.2, bias=bias), torch.float32, "packed bias")


@pytest.mark.parametrize("case", ["not-a-pair", "table-fp16", "table-heads", "table-even", "table-strided",
                                  "positions-int64", "positions-length", "device-meta"])
def test_bias_bad_input_raises_before_launch(case, monkeypatch):
    monkeypatch.setattr(attention_mod, "_attention_kernel", NoLaunch())
    cu = [0, 3, 8]
    q, k, v, cu_t = packed(cu, 32, torch.float32)
    table, positions = relative_bias(cu)
    if case == "not-a-pair":
        bias = table
    elif case == "table-fp16":
        bias = (table.half(), positions)
    elif case == "table-heads":
        bias = (table[:1], positions)
    elif case == "table-even":
        bias = (table[:, 1:], positions)
    elif case == "table-strided":
        bias = (torch.zeros(HEADS, 2 * table.shape[1])[:, ::2], positions)
    elif case == "positions-int64":
        bias = (table, positions.long())
    elif case == "positions-length":
        bias = (table, positions[:-1])
    elif case == "device-meta":
        bias = (table.to("meta"), positions.to("meta"))
    with pytest.raises(ValueError, match="attention: "):
        attention_varlen(q, k, v, cu_t, 5, 0.1, bias=bias)
