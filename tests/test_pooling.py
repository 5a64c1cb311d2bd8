"""Sentence pooling on the packed tokens (`sentence.pool_packed`, what `embed_tokens` runs on the CPU for cls and
mean pooling) against `pool` on the same tokens padded: the same vectors, each row's from its own tokens alone."""

from __future__ import annotations

import pytest
import torch

from bertfast import Encoder
from bertfast.padding import pad, unpad
from bertfast.sentence import PACKED_MODES, pool, pool_packed

MODES = [("mean",), ("cls",), ("mean_sqrt_len_tokens",), ("cls", "mean", "mean_sqrt_len_tokens")]


def _batch(lengths, H=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = max(lengths)
    mask = torch.zeros(len(lengths), S, dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    packed = torch.randn(sum(lengths), H, generator=gen)
    _, indices, cu_seqlens, _ = unpad(torch.zeros(len(lengths), S), mask)
    return packed, cu_seqlens, pad(packed, indices, len(lengths), S), mask


@pytest.mark.parametrize("modes", MODES, ids="+".join)
@pytest.mark.parametrize("lengths", [[5], [3, 0, 7, 1], [64, 2, 130, 9]], ids=str)
def test_pool_packed_is_pool(modes, lengths):
    packed, cu_seqlens, padded, mask = _batch(lengths)
    ours = pool_packed(packed, cu_seqlens, modes)
    ref = pool(padded, mask, modes)
    assert ours.shape == ref.shape == (len(lengths), len(modes) * packed.shape[1])
    # `pool` sums a row as a masked reduction over S, pool_packed token after token: fp32 rounding apart (<= ~1e-6 for
    # 130 tokens of unit scale); bit-exactness is asserted against pool_packed_reference below.
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    if modes == ("cls",):
        assert torch.equal(ours, ref)  # a copy of each row's first token (zeros for a row without one)


def test_pool_packed_rows_alone():
    """A row's vector is the same bits alone as among other rows of any lengths."""
    lengths = [3, 40, 0, 17, 128]
    packed, cu_seqlens, _, _ = _batch(lengths, seed=1)
    together = pool_packed(packed, cu_seqlens, ("cls", "mean"))
    for b, n in enumerate(lengths):
        lo = int(cu_seqlens[b])
        alone = pool_packed(packed[lo:lo + n], torch.tensor([0, n], dtype=torch.int32), ("cls", "mean"))
        assert torch.equal(alone[0], together[b]), b


def test_modes_outside_the_packed_ones_are_refused():
    packed, cu_seqlens, _, _ = _batch([4, 2])
    assert set(PACKED_MODES) == {"cls", "mean", "mean_sqrt_len_tokens"}
    with pytest.raises(ValueError, match="'max' pools a padded batch"):
        pool_packed(packed, cu_seqlens, ("mean", "max"))


@pytest.mark.parametrize("pooling", ["mean", "cls", "max", ("cls", "mean")], ids=str)
def test_embed_tokens_packed_and_padded_agree(tiny_text_model, pooling):
    """embed_tokens on the CPU (packed pooling for cls / mean, `pool` for max) gives what the padded last state
    pools to, and each row alone the same bits as in the batch."""
    enc = Encoder.from_pretrained(tiny_text_model)
    texts = ["a short one", "", "a somewhat longer text than the others " * 3, "x"]
    ids, mask, types = enc.tokenize(texts)
    ours = enc.embed_tokens(ids, mask, types, pooling=pooling)
    last = enc(ids, mask, types).last_hidden_state.float()
    modes = (pooling,) if isinstance(pooling, str) else pooling
    # the padded path's masked sum adds in another order (fp32 rounding apart); rows alone vs in batch: bits, below
    torch.testing.assert_close(ours, enc.sentence_config.embed(last, mask, pooling=modes), rtol=1e-6, atol=1e-6)
    for i in range(len(texts)):
        n = int(mask[i].sum())
        alone = enc.embed_tokens(ids[i:i + 1, :n], mask[i:i + 1, :n], types[i:i + 1, :n], pooling=pooling)
        assert torch.equal(alone[0], ours[i]), i


@pytest.mark.parametrize("modes", MODES, ids="+".join)
def test_native_pool_rows_is_the_torch_formulation(modes):
    """`_C.pool_rows` (what pool_packed runs on the CPU) gives the bits of the torch ops it replaces."""
    from bertfast.backends.cpu.ext import _C
    from bertfast.sentence import pool_packed_reference

    if _C is None:
        pytest.skip("the extension is not built")
    packed, cu_seqlens, _, _ = _batch([1, 0, 37, 130, 5] + list(range(2, 200, 7)), H=384, seed=2)
    assert torch.equal(pool_packed(packed, cu_seqlens, modes), pool_packed_reference(packed, cu_seqlens, modes))
    strided = torch.cat([packed, packed], dim=1)[:, :384]  # rows 768 floats apart
    assert torch.equal(pool_packed(strided, cu_seqlens, modes), pool_packed_reference(packed, cu_seqlens, modes))


def test_pool_rows_checks_its_arguments():
    from bertfast.backends.cpu.ext import _C

    if _C is None:
        pytest.skip("the extension is not built")
    x, cu = torch.randn(5, 8), torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="mode must be 'cls' or 'mean'"):
        _C.pool_rows(x, cu, "max")
    with pytest.raises(ValueError, match="float32"):
        _C.pool_rows(x.double(), cu, "mean")
    with pytest.raises(ValueError):
        _C.pool_rows(x, torch.tensor([0, 2, 6], dtype=torch.int32), "mean")  # past the last token
