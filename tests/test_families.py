"""Every supported family against its own transformers model: random small configs (tests/helpers/families.py),
ragged batches."""

import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder
from conftest import rel_err
from helpers.families import COMMON, CPU_BACKENDS, FAMILIES, batch_for, build


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(family, backend):
    model = build(family)
    kwargs, mask = batch_for(model, [40, 1, 9, 23])
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    enc = Encoder.from_hf(model, backend=backend)
    out = enc(**kwargs, output_hidden_states=True)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
    if getattr(ref, "pooler_output", None) is not None:
        assert rel_err(out.pooler_output, ref.pooler_output) <= 1e-5
    else:
        assert out.pooler_output is None
    assert len(out.hidden_states) == len(ref.hidden_states)
    for ours, theirs in zip(out.hidden_states, ref.hidden_states):
        assert rel_err(ours, theirs, mask) <= 1e-5


@pytest.mark.parametrize("family", ["roberta", "electra", "albert", "distilbert", "mpnet"])
def test_family_from_saved_directory(tmp_path, family):
    model = build(family, seed=2)
    model.save_pretrained(tmp_path)
    kwargs, mask = batch_for(model, [7, 3], seed=3)
    with torch.no_grad():
        ref = model(**kwargs).last_hidden_state
    out = Encoder.from_pretrained(tmp_path, backend="torch")(**kwargs).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5


def test_albert_shared_layers_are_not_copied():
    enc = Encoder.from_hf(build("albert"), backend="torch")
    layers = enc.engine.weights.layers
    # 3 layers over 2 groups: transformers runs group int(i / 1.5) = 0, 0, 1
    assert len(layers) == 3 and layers[0] is layers[1] and layers[2] is not layers[0]


def test_roberta_length_limit_counts_the_pad_offset():
    enc = Encoder.from_hf(build("roberta"), backend="torch")
    with pytest.raises(ValueError, match="limit of 38 tokens"):
        enc(torch.full((1, 39), 5))
    assert enc(torch.full((1, 38), 5)).last_hidden_state.shape == (1, 38, 64)


def test_distilbert_rejects_token_types():
    enc = Encoder.from_hf(build("distilbert"), backend="torch")
    with pytest.raises(ValueError, match="no token types"):
        enc(torch.ones(1, 3, dtype=torch.long), token_type_ids=torch.zeros(1, 3, dtype=torch.long))


def test_relative_position_embeddings_are_rejected():
    cfg = transformers.BertConfig(**COMMON, position_embedding_type="relative_key")
    with pytest.raises(bertfast.ConfigError, match="position_embedding_type"):
        Encoder.from_hf(transformers.BertModel(cfg), backend="torch")
