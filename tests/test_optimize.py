"""`bertfast.optimize`: task models of every family keep their class, outputs and heads."""

import sys
import warnings

import pytest
import torch
import transformers

import bertfast
from conftest import rel_err
from helpers.families import COMMON, CPU_BACKENDS, NO_TYPES, batch_for
from helpers.families import build as build_family
from helpers.outputs import compare


def _config(family):
    if family == "bert":
        return transformers.BertConfig(**COMMON, num_labels=2)
    if family == "roberta":
        return transformers.RobertaConfig(**{**COMMON, "type_vocab_size": 1}, pad_token_id=1, num_labels=2)
    if family == "xlm-roberta":
        return transformers.XLMRobertaConfig(**{**COMMON, "type_vocab_size": 1}, pad_token_id=1, num_labels=2)
    if family == "electra":
        return transformers.ElectraConfig(**COMMON, embedding_size=32, num_labels=2)
    if family == "albert":
        return transformers.AlbertConfig(**COMMON, embedding_size=16, num_labels=2)
    if family == "mpnet":
        return transformers.MPNetConfig(**NO_TYPES, num_labels=2)
    if family == "deberta-v2":  # v3 style: shared keys, log buckets, normed relative embeddings, no positions
        return transformers.DebertaV2Config(**NO_TYPES, num_labels=2, relative_attention=True, pos_att_type="p2c|c2p",
                                            share_att_key=True, position_buckets=8, norm_rel_ebd="layer_norm",
                                            position_biased_input=False)
    return transformers.DistilBertConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, hidden_dim=96,
                                         max_position_embeddings=40, num_labels=2)


MODELS = [
    ("bert", "BertModel"), ("bert", "BertForSequenceClassification"), ("bert", "BertForTokenClassification"),
    ("bert", "BertForQuestionAnswering"), ("bert", "BertForMultipleChoice"), ("bert", "BertForMaskedLM"),
    ("bert", "BertForNextSentencePrediction"), ("bert", "BertForPreTraining"),
    ("roberta", "RobertaForSequenceClassification"), ("roberta", "RobertaForMaskedLM"),
    ("xlm-roberta", "XLMRobertaForTokenClassification"),
    ("electra", "ElectraForPreTraining"), ("electra", "ElectraForSequenceClassification"),
    ("albert", "AlbertForMaskedLM"), ("albert", "AlbertForSequenceClassification"),
    ("distilbert", "DistilBertForQuestionAnswering"), ("distilbert", "DistilBertForSequenceClassification"),
    ("mpnet", "MPNetModel"), ("mpnet", "MPNetForSequenceClassification"), ("mpnet", "MPNetForMaskedLM"),
    ("mpnet", "MPNetForMultipleChoice"),
    ("deberta-v2", "DebertaV2Model"), ("deberta-v2", "DebertaV2ForSequenceClassification"),
    ("deberta-v2", "DebertaV2ForTokenClassification"), ("deberta-v2", "DebertaV2ForQuestionAnswering"),
    ("deberta-v2", "DebertaV2ForMultipleChoice"), ("deberta-v2", "DebertaV2ForMaskedLM"),
]


def build(family, cls_name, seed=0):
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(_config(family)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs_for(model, multiple_choice=False):
    kwargs, mask = batch_for(model, [40, 1, 9, 23, 5, 17], seed=4)
    if multiple_choice:  # [B, C, S]: 3 questions x 2 choices
        kwargs = {k: v.view(3, 2, -1) for k, v in kwargs.items()}
    return kwargs, mask


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family, cls_name", MODELS, ids=[m[1] for m in MODELS])
def test_optimized_model_matches_original(family, cls_name, backend):
    model = build(family, cls_name)
    kwargs, mask = inputs_for(model, multiple_choice="MultipleChoice" in cls_name)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    keys_before = list(model.state_dict())
    assert bertfast.optimize(model, backend=backend, strict=True) is model
    assert type(model).__name__ == cls_name and isinstance(model.base_model, type(build(family, cls_name).base_model))
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
    assert type(out) is type(ref)
    compare(out, ref, mask)
    assert list(model.state_dict()) == keys_before


def test_unsupported_calls_fall_back_with_one_warning():
    model = build("bert", "BertForSequenceClassification")
    kwargs, _ = inputs_for(model)
    with torch.no_grad():
        ref = model(**kwargs, output_attentions=True)
    bertfast.optimize(model, backend="torch")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = model(**kwargs, output_attentions=True)
            model(**kwargs, output_attentions=True)
    messages = [str(w.message) for w in caught if "bertfast" in str(w.message)]
    assert len(messages) == 1 and "output_attentions" in messages[0]
    assert len(out.attentions) == len(ref.attentions) and torch.allclose(out.logits, ref.logits)


@pytest.mark.parametrize("major", [4, 5])
def test_albert_inner_groups_hidden_states_follow_the_installed_transformers(major, monkeypatch):
    """transformers 5 gives a hidden state per inner layer of an ALBERT group (as the engine), transformers 4 one per
    group: under 4 the engine serves the call only without hidden states."""
    monkeypatch.setattr(sys.modules["bertfast.optimize"], "_transformers_major", lambda: major)
    model = build_family("albert-inner2")
    kwargs, mask = batch_for(model, [9, 4])
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    bertfast.optimize(model, backend="torch", strict=True)
    with torch.no_grad():
        assert rel_err(model(**kwargs).last_hidden_state, ref.last_hidden_state, mask) <= 1e-5
        if major == 5:
            compare(model(**kwargs, output_hidden_states=True), ref, mask)
        else:
            with pytest.raises(bertfast.EngineUnsupported, match="inner_group_num"):
                model(**kwargs, output_hidden_states=True)


def test_strict_mode_raises_and_training_falls_back():
    model = build("bert", "BertForTokenClassification")
    kwargs, _ = inputs_for(model)
    bertfast.optimize(model, backend="torch", strict=True)
    with pytest.raises(bertfast.EngineUnsupported, match="output_attentions"):
        model(**kwargs, output_attentions=True)
    model.train()
    with pytest.raises(bertfast.EngineUnsupported, match="training mode"):
        model(**kwargs)
    bertfast.optimize(model.eval(), backend="torch")  # again, non-strict: training now falls back
    model.train()
    with pytest.warns(UserWarning, match="training mode"):
        out = model(**kwargs, labels=torch.zeros_like(kwargs["input_ids"]))
    out.loss.backward()  # the original modules ran: gradients flow
    assert model.classifier.weight.grad is not None


def test_left_padding_with_pooler_falls_back_to_exact_answer():
    model = build("bert", "BertForSequenceClassification")
    ids = torch.randint(1, 97, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    bertfast.optimize(model, backend="torch")
    with pytest.warns(UserWarning, match="left padding"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(out, ref)


@pytest.mark.parametrize("family, cls_name", [("roberta", "RobertaForSequenceClassification"),
                                             ("distilbert", "DistilBertForSequenceClassification")])
def test_left_padding_under_a_head_reading_position_0_falls_back(family, cls_name):
    model = build(family, cls_name)  # no pooler: the head itself reads last_hidden_state[:, 0]
    ids = torch.randint(2, 97, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    bertfast.optimize(model, backend="torch")
    with pytest.warns(UserWarning, match="left padding under a head"), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(out, ref)


def test_bf16_engine_feeds_fp32_head():
    model = build("bert", "BertForSequenceClassification")
    kwargs, _ = inputs_for(model)
    with torch.no_grad():
        ref = model(**kwargs).logits
    bertfast.optimize(model, backend="torch", dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(**kwargs).logits
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 5e-2  # bf16 encoder: agreement to bf16 precision, not bit-exact
