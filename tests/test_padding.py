import pytest
import torch

from bertfast.padding import pad, unpad


@pytest.mark.parametrize("kind", ["random", "full", "one-per-row", "empty-row", "left-and-holes"])
def test_unpad_pad_round_trip(kind):
    g = torch.Generator().manual_seed(1)
    B, S, H = 5, 9, 3
    if kind == "random":
        mask = torch.rand(B, S, generator=g) < 0.6
    elif kind == "full":
        mask = torch.ones(B, S, dtype=torch.bool)
    elif kind == "one-per-row":
        mask = torch.zeros(B, S, dtype=torch.bool)
        mask[:, 0] = True
    elif kind == "empty-row":
        mask = torch.arange(S)[None] < torch.tensor([3, 0, 9, 1, 0])[:, None]
    else:
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0, 1, 0, 1]] * 2 + [[1] * 9]).bool()
    hidden = torch.randn(B, S, H, generator=g)
    packed, indices, cu_seqlens, max_seqlen = unpad(hidden, mask)
    lengths = mask.sum(1)
    assert packed.shape == (int(lengths.sum()), H)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist()
    assert max_seqlen == int(lengths.max())
    # packed holds each row's real tokens, in order
    expected = torch.cat([hidden[b][mask[b]] for b in range(B)])
    assert torch.equal(packed, expected)
    back = pad(packed, indices, B, S)
    assert torch.equal(back[mask], hidden[mask])
    assert (back[~mask] == 0).all()


def test_unpad_integer_tokens():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    mask = ids != 0
    packed, indices, cu, m = unpad(ids, mask)
    assert packed.tolist() == [5, 6, 7] and indices.tolist() == [0, 1, 3] and cu.tolist() == [0, 2, 3] and m == 2
