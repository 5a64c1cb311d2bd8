"""DeBERTa-v2/v3 (and mDeBERTa, the same class): config, loading and the oracle against transformers.

The oracle (`reference.forward`) against transformers' DebertaV2Model in fp32 on ragged batches with a 1-token row
and rows past the relative span / bucket horizon, for every config style of tests/helpers/deberta.py; left padding
and masks with holes (relative positions count columns); the log buckets op for op; loading from a saved directory
and from task checkpoints' prefix; clear errors for what is not supported or missing. The engine's backends:
test_deberta_engine.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from bertfast import disentangled, reference
from bertfast.config import ConfigError, ModelConfig
from bertfast.loading import LoadError, assemble, load_hf_model, load_pretrained
from conftest import rel_err
from helpers.deberta import BASE, CONFIGS, LENGTHS, batch, build


def _compare(model, ids, mask, types=None, tol=1e-6):
    kwargs = {} if types is None else dict(token_type_ids=types)
    with torch.no_grad():
        theirs = model(ids, attention_mask=mask, output_hidden_states=True, **kwargs)
    ours = reference.forward(load_hf_model(model, torch.float64), ids, mask, output_hidden_states=True, **kwargs)
    assert rel_err(ours[0], theirs.last_hidden_state, mask) <= tol
    for a, b in zip(ours[2], theirs.hidden_states, strict=True):
        assert rel_err(a, b, mask) <= tol


def test_log_buckets_match_transformers():
    mod = transformers.models.deberta_v2.modeling_deberta_v2
    r = torch.arange(-700, 701)
    for buckets, max_position in ((256, 512), (16, 64), (8, 32), (2, 5)):
        assert torch.equal(disentangled.log_bucket(r, buckets, max_position),
                           mod.make_log_bucket_position(r, buckets, max_position).long())


def test_config_fields():
    v3 = ModelConfig.from_dict(build("v3").config.to_dict())
    assert (v3.family, v3.pos_att_type, v3.share_att_key, v3.norm_rel_ebd, v3.position_biased_input) == \
        ("deberta-v2", ("c2p", "p2c"), True, True, False)
    assert (v3.position_buckets, v3.att_span, v3.type_vocab_size, v3.layer_norm_eps) == (16, 16, 0, 1e-7)
    assert v3.disentangled and v3.attention_scale == pytest.approx((16 * 3) ** -0.5)
    v2 = ModelConfig.from_dict(transformers.DebertaV2Config(**{**BASE, **CONFIGS["v2"]}).to_dict())
    assert (v2.position_buckets, v2.att_span, v2.share_att_key, v2.type_vocab_size) == (0, 24, False, 2)
    default = ModelConfig.from_dict({**BASE, "model_type": "deberta-v2", "relative_attention": True,
                                     "pos_att_type": ["c2p"]})
    assert default.att_span == 64  # max_relative_positions < 1: max_position_embeddings, as transformers reads it
    plain = ModelConfig.from_dict({**BASE, "model_type": "deberta-v2", "relative_attention": False,
                                   "pos_att_type": ["c2p", "p2c"]})
    assert not plain.disentangled and plain.attention_scale == pytest.approx((16 * 3) ** -0.5)


@pytest.mark.parametrize("field, value, words", [
    ("conv_kernel_size", 3, "ConvLayer"),
    ("embedding_size", 32, "embedding projection"),
    ("pos_att_type", ["c2p", "p2p"], "pos_att_type"),
    ("norm_rel_ebd", "batch_norm", "norm_rel_ebd"),
    ("attention_head_size", 8, "attention_head_size"),
    ("share_att_key", "yes", "share_att_key"),
])
def test_config_refuses_what_is_not_implemented(field, value, words):
    d = {**BASE, **CONFIGS["v3"], "model_type": "deberta-v2", field: value}
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("style", ["v2", "v3", "c2p", "p2c"])
def test_reference_matches_transformers(style):
    model = build(style)
    ids, mask, types = batch(type_vocab=model.config.type_vocab_size)
    _compare(model, ids, mask, types if model.config.type_vocab_size else None)


def test_reference_past_256_buckets():
    """deberta-v3's 256 buckets (span 256, log buckets from 128 on): a 300-token row next to short ones."""
    model = build("v3-256", num_hidden_layers=1)
    ids, mask, _ = batch([300, 1, 140, 9], vocab=97)
    _compare(model, ids, mask)


@pytest.mark.parametrize("layout", ["left", "holes"])
def test_reference_masks(layout):
    model = build("v3")
    ids, mask, _ = batch(layout=layout)
    _compare(model, ids, mask)


def test_plain_attention_without_relative():
    """relative_attention false: no position terms, but pos_att_type still divides the scale (as transformers)."""
    model = build("v2", relative_attention=False)
    ids, mask, types = batch(type_vocab=2)
    _compare(model, ids, mask, types)


def test_loads_saved_directory_and_task_prefix(tmp_path):
    model = build("v3", task="SequenceClassification", num_labels=3)
    model.save_pretrained(tmp_path)
    from_dir = load_pretrained(tmp_path, torch.float64)
    from_mem = load_hf_model(model.deberta, torch.float64)
    for a, b in zip(from_dir.layers, from_mem.layers, strict=True):
        assert torch.equal(a.pos_key, b.pos_key) and torch.equal(a.pos_query, b.pos_query)
        assert torch.equal(a.qkv_weight, b.qkv_weight)
    assert from_dir.embeddings.position is None and from_dir.embeddings.token_type is None


def test_errors_name_the_tensor():
    model = build("v2")
    sd = dict(model.state_dict())
    cfg = ModelConfig.from_dict(model.config.to_dict())

    def source(state):
        from bertfast.loading import _TensorSource
        return _TensorSource({k: "the test's dict" for k in state}, state.__getitem__)

    missing = {k: v for k, v in sd.items() if k != "encoder.layer.1.attention.self.pos_key_proj.weight"}
    with pytest.raises(LoadError, match=r"encoder\.layer\.1\.attention\.self\.pos_key_proj\.weight"):
        assemble(source(missing), cfg)
    wrong = {**sd, "encoder.rel_embeddings.weight": sd["encoder.rel_embeddings.weight"][:-1]}
    with pytest.raises(LoadError, match=r"encoder\.rel_embeddings\.weight.*shape"):
        assemble(source(wrong), cfg)


def test_encoder_on_torch_backend():
    """The engine's composition (c2p / p2c per layer from q and k, gathered per pair) on the reference ops."""
    import bertfast

    model = build("v2")
    ids, mask, types = batch(type_vocab=2)
    with torch.no_grad():
        theirs = model(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    enc = bertfast.Encoder.from_hf(model, backend="torch", dtype=torch.float64)
    assert rel_err(enc(ids, attention_mask=mask, token_type_ids=types)[0], theirs, mask) <= 1e-6
