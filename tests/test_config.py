import json

import pytest

from bertfast.config import ConfigError, ModelConfig

BASE = {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 128, "hidden_act": "gelu", "layer_norm_eps": 1e-12, "vocab_size": 100,
        "max_position_embeddings": 32, "type_vocab_size": 2, "pad_token_id": 0}


def test_parses_real_minilm_config(minilm_path):
    cfg = ModelConfig.from_json(minilm_path)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers) == (384, 12, 32, 6)
    assert cfg.intermediate_size == 1536 and cfg.vocab_size == 30522 and cfg.activation == "gelu"
    assert cfg.layer_norm_eps == 1e-12 and cfg.max_position_embeddings == 512


@pytest.mark.parametrize("act, engine_act", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"),
                                             ("gelu_pytorch_tanh", "gelu_tanh"), ("relu", "relu")])
def test_activations(act, engine_act):
    assert ModelConfig.from_dict({**BASE, "hidden_act": act}).activation == engine_act


def test_defaults_for_optional_fields():
    d = {k: v for k, v in BASE.items() if k not in ("layer_norm_eps", "type_vocab_size", "pad_token_id")}
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_norm_eps == 1e-12 and cfg.type_vocab_size == 2 and cfg.pad_token_id == 0


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "swish"}, "hidden_act"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "t5"}, "model_type"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"hidden_size": 66}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"vocab_size": "many"}, "vocab_size"),
    ({"layer_norm_eps": "small"}, "layer_norm_eps"),
    ({"is_decoder": True}, "is_decoder"),
], ids=lambda x: str(x) if isinstance(x, str) else None)
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**BASE, **change})


@pytest.mark.parametrize("missing", ["model_type", "hidden_size", "num_attention_heads", "intermediate_size",
                                     "vocab_size"])
def test_missing_field_is_named(missing):
    with pytest.raises(ConfigError, match=missing):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != missing})


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert ModelConfig.from_json(tmp_path).hidden_size == 64


def test_family_specific_fields():
    distil = ModelConfig.from_dict({"model_type": "distilbert", "dim": 64, "n_heads": 4, "n_layers": 3,
                                    "hidden_dim": 96, "activation": "gelu", "vocab_size": 50,
                                    "max_position_embeddings": 20})
    assert (distil.hidden_size, distil.num_attention_heads, distil.num_hidden_layers) == (64, 4, 3)
    assert distil.intermediate_size == 96 and distil.type_vocab_size == 0 and distil.layer_norm_eps == 1e-12
    roberta = ModelConfig.from_dict({**BASE, "model_type": "roberta", "pad_token_id": 1})
    assert roberta.positions_from_input_ids and roberta.max_sequence_length == 30
    electra = ModelConfig.from_dict({**BASE, "model_type": "electra", "embedding_size": 16})
    assert electra.embedding_size == 16 and not electra.positions_from_input_ids
    albert = ModelConfig.from_dict({**BASE, "model_type": "albert", "embedding_size": 8, "num_hidden_groups": 2,
                                    "inner_group_num": 1, "hidden_act": "gelu_new"})
    assert (albert.embedding_size, albert.num_hidden_groups, albert.inner_group_num) == (8, 2, 1)
    assert ModelConfig.from_dict(BASE).embedding_size == 64
