"""The reference model against transformers itself: the oracle must be exact before it judges."""

import pytest
import torch

from bertfast import reference
from bertfast.loading import load_hf_model
from conftest import hf_bert, ragged_batch, rel_err

CONFIGS = [
    pytest.param(dict(hidden_size=64, num_attention_heads=4, intermediate_size=96), id="H64-d16"),
    pytest.param(dict(hidden_size=312, num_attention_heads=12, intermediate_size=400), id="H312-d26"),
    pytest.param(dict(hidden_size=128, num_attention_heads=4, intermediate_size=256, hidden_act="gelu_new"),
                 id="H128-d32-gelu_new"),
    pytest.param(dict(hidden_size=160, num_attention_heads=2, intermediate_size=320, num_hidden_layers=1,
                      hidden_act="relu"), id="H160-d80-relu"),
    pytest.param(dict(hidden_size=256, num_attention_heads=4, intermediate_size=512,
                      hidden_act="gelu_pytorch_tanh"), id="H256-d64-tanh"),
]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("overrides", CONFIGS)
def test_reference_matches_transformers(overrides, attn):
    model = hf_bert(seed=3, attn=attn, **overrides)
    P = model.config.max_position_embeddings
    ids, mask, types = ragged_batch([5, 1, P, 17, 2], seqlen=P, seed=4)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    weights = load_hf_model(model)
    last, pooled, states = reference.forward(weights, ids, mask, types, output_hidden_states=True)
    assert rel_err(last, hf.last_hidden_state, mask) <= 1e-5
    assert rel_err(pooled, hf.pooler_output) <= 1e-5
    assert len(states) == len(hf.hidden_states)
    for ours, theirs in zip(states, hf.hidden_states):
        assert rel_err(ours, theirs, mask) <= 1e-5


def test_reference_fp64_is_the_tighter_oracle():
    model = hf_bert(seed=5)
    ids, mask, types = ragged_batch([7, 3], seed=6)
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    last64, _, _ = reference.forward(load_hf_model(model, dtype=torch.float64), ids, mask, types)
    assert last64.dtype == torch.float64
    # fp32 transformers sits within fp32 rounding of the fp64 reference
    assert rel_err(hf.last_hidden_state, last64, mask) <= 1e-5


def test_position_ids_and_token_types_are_used():
    model = hf_bert(seed=7)
    ids, mask, types = ragged_batch([6, 6], seed=8)
    pos = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 2, 4, 6, 8, 10]])
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, token_type_ids=types, position_ids=pos)
    last, _, _ = reference.forward(load_hf_model(model), ids, mask, types, pos)
    assert rel_err(last, hf.last_hidden_state, mask) <= 1e-5
    other, _, _ = reference.forward(load_hf_model(model), ids, mask, None, None)
    assert rel_err(other, last, mask) > 1e-3


def test_attention_varlen_equals_per_sequence_loop():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 1, 17, 17, 80, 81], dtype=torch.int32)
    q, k, v = (torch.randn(81, 3, 8, generator=g, dtype=torch.float64) for _ in range(3))
    a = reference.attention(q, k, v, cu, 63, 0.3)
    b = reference.attention_loop(q, k, v, cu, 0.3)
    assert a.shape == (81, 24) and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_fully_masked_row_is_finite():
    q = torch.randn(1, 2, 4, 8)
    out = reference.attention_padded(q, q, q, torch.zeros(1, 4, dtype=torch.bool), 0.35)
    assert torch.isfinite(out).all()
