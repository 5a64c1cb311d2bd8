"""config.json of ModernBERT, NomicBERT, GTE: what is parsed, and the field every rejection names."""

import pytest

from bertfast.config import ConfigError, ModelConfig

COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3, "intermediate_size": 96,
          "vocab_size": 100}
MODERN = {**COMMON, "model_type": "modernbert", "local_attention": 8, "global_attn_every_n_layers": 2}
NOMIC = {**COMMON, "model_type": "nomic_bert", "hidden_act": "silu", "type_vocab_size": 2}
GTE = {**COMMON, "model_type": "gte", "hidden_act": "gelu", "type_vocab_size": 1}


def test_modernbert_fields():
    cfg = ModelConfig.from_dict(MODERN)
    assert cfg.layer_windows == (0, 4, 0) and cfg.window(1) == 4  # local_attention 8: 4 tokens each side
    assert (cfg.rope_theta, cfg.local_rope_theta) == (160_000.0, 10_000.0)
    assert cfg.norm_first and cfg.gated_ffn and cfg.rotary and cfg.activation == "gelu"
    assert cfg.type_vocab_size == 0 and cfg.layer_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    # transformers 5's spelling: layer_types and per-type rope_parameters; norm_eps for every norm
    cfg = ModelConfig.from_dict({**MODERN, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e4},
                                                     "sliding_attention": {"rope_type": "default", "rope_theta": 7e3}},
                                 "norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh"})
    assert cfg.layer_windows == (4, 0, 4) and (cfg.rope_theta, cfg.local_rope_theta) == (5e4, 7e3)
    assert cfg.layer_norm_eps == 1e-6 and cfg.activation == "gelu_tanh"
    # the older top-level spellings
    cfg = ModelConfig.from_dict({**MODERN, "global_rope_theta": 2e4, "local_rope_theta": 3e3})
    assert (cfg.rope_theta, cfg.local_rope_theta) == (2e4, 3e3)


def test_nomic_and_gte_fields():
    nomic, gte = ModelConfig.from_dict(NOMIC), ModelConfig.from_dict(GTE)
    assert nomic.rope_theta == 1000.0 and nomic.activation == "silu" and nomic.type_vocab_size == 2
    assert gte.rope_theta == 160_000.0 and gte.type_vocab_size == 1
    for cfg in (nomic, gte):
        assert cfg.gated_ffn and not cfg.norm_first and cfg.layer_windows == () and cfg.local_rope_theta == 0
    cfg = ModelConfig.from_dict({**GTE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                 "type_vocab_size": 0})
    assert cfg.rope_theta == 5e5 and cfg.type_vocab_size == 0


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}


@pytest.mark.parametrize("base, change, field", [
    (MODERN, {"rope_parameters": {"full_attention": YARN}}, r"rope_parameters.full_attention.*rope_type 'yarn'"),
    (MODERN, {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters.sliding_attention.*rope_type 'linear'"),
    (NOMIC, {"rope_parameters": YARN}, r"'rope_parameters' has rope_type 'yarn'"),
    (GTE, {"rope_scaling": {"type": "ntk", "factor": 2.0}}, "rope_scaling"),
    (NOMIC, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    (GTE, {"rope_parameters": {"rope_theta": -1}}, "rope_theta"),
    (NOMIC, {"rope_parameters": "big"}, "rope_parameters"),
    (NOMIC, {"head_dim": 32}, "head_dim"),
    (MODERN, {"hidden_activation": "tanh"}, "hidden_activation"),
    (NOMIC, {"hidden_act": "tanh"}, "hidden_act"),
    (MODERN, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    (MODERN, {"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "layer_types"),
    (MODERN, {"local_attention": 1}, "local_attention"),
    (MODERN, {"attention_bias": "no"}, "attention_bias"),
    (MODERN, {"num_hidden_layers": 0}, "num_hidden_layers"),
    (GTE, {"hidden_size": 66}, "hidden_size"),
], ids=["modern-yarn", "modern-linear", "nomic-yarn", "rope-scaling", "partial-rotary", "theta", "rope-params-type",
        "head-dim", "modern-activation", "nomic-activation", "layer-types-count", "layer-types-kind", "window",
        "bias-flag", "layers", "hidden"])
def test_bad_values_name_the_field(base, change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**base, **change})
