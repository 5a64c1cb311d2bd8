"""Every supported family against its own transformers model: random small configs, ragged batches."""

import pytest
import torch

import bertfast
from bertfast import Encoder
from conftest import ragged_batch, rel_err

transformers = pytest.importorskip("transformers")

CPU_BACKENDS = [n for n, r in bertfast.available_backends("cpu").items() if r is None and n != "triton"]
COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-12)
NO_TYPES = {k: v for k, v in COMMON.items() if k != "type_vocab_size"}  # MPNet has no token types

FAMILIES = {
    "bert": lambda: transformers.BertModel(transformers.BertConfig(**COMMON)),
    "roberta": lambda: transformers.RobertaModel(transformers.RobertaConfig(**{**COMMON, "type_vocab_size": 1},
                                                                            pad_token_id=1)),
    "xlm-roberta": lambda: transformers.XLMRobertaModel(transformers.XLMRobertaConfig(
        **{**COMMON, "type_vocab_size": 1, "hidden_act": "gelu_new"}, pad_token_id=1)),
    "electra": lambda: transformers.ElectraModel(transformers.ElectraConfig(**COMMON, embedding_size=32)),
    "electra-same-size": lambda: transformers.ElectraModel(transformers.ElectraConfig(**COMMON, embedding_size=64)),
    "albert": lambda: transformers.AlbertModel(transformers.AlbertConfig(
        **{**COMMON, "num_hidden_layers": 3}, embedding_size=16, num_hidden_groups=2, inner_group_num=1)),
    "albert-inner2": lambda: transformers.AlbertModel(transformers.AlbertConfig(
        **COMMON, embedding_size=16, num_hidden_groups=1, inner_group_num=2, hidden_act="relu")),
    "distilbert": lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=97, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=40)),
    "distilbert-sinusoidal": lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=97, dim=64, n_layers=1, n_heads=2, hidden_dim=96, max_position_embeddings=40,
        sinusoidal_pos_embds=True)),
    "mpnet": lambda: transformers.MPNetModel(transformers.MPNetConfig(**NO_TYPES, hidden_act="gelu_new")),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[name]().eval()
    with torch.no_grad():  # random init leaves LayerNorms at identity and biases at zero
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch_for(model, lengths, seed=1):
    cfg = model.config
    pad = cfg.pad_token_id or 0
    limit = cfg.max_position_embeddings - (pad + 1 if cfg.model_type in ("roberta", "xlm-roberta", "mpnet") else 0)
    lengths = [min(n, limit) for n in lengths]
    ids, mask, types = ragged_batch(lengths, vocab=cfg.vocab_size, seed=seed)
    ids = torch.where(mask.bool(), ids.clamp_min(pad + 1), torch.full_like(ids, pad))
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if getattr(cfg, "type_vocab_size", 0) > 1:
        kwargs["token_type_ids"] = types
    return kwargs, mask


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
