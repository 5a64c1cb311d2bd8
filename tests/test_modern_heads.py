"""ModernBERT, NomicBERT, GTE task heads (`load`) and `optimize` against transformers' own task models.

Random small configs (tests/helpers/modern_tasks.py: hidden 64, 3 layers; ModernBERT with a sliding window of 8
tokens every other layer), ragged batches with a 1-token row and rows longer than the window, fp32 at <= 1e-5 relative.
"""

import json
import sys
import warnings

import pytest
import torch
import transformers

import bertfast
from bertfast.heads import TaskModel, load, supported_architectures
from conftest import rel_err
from helpers.modern_tasks import BACKENDS, PREFIX, build, inputs_for
from helpers.outputs import check_against, compare


TASKS = {"modernbert": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice",
                        "MaskedLM"],
         "nomic_bert": ["SequenceClassification", "TokenClassification", "MaskedLM"],
         "gte": ["SequenceClassification", "TokenClassification", "MaskedLM"]}
# Per family, a second config flipping what the heads read from config.json: ModernBERT's pooling, biases,
# classifier activation (not the layers'), untied decoders; GTE without token types (gte-base-en-v1.5).
VARIANTS = {
    "modernbert": dict(classifier_pooling="mean", classifier_bias=True, norm_bias=True, decoder_bias=False,
                       classifier_activation="silu", hidden_activation="gelu_new", tie_word_embeddings=False),
    "nomic_bert": dict(tie_word_embeddings=False),
    "gte": dict(tie_word_embeddings=False, type_vocab_size=0),
}

CASES = [(f, t, v) for f in TASKS for t in TASKS[f] for v in (False, True)
         if not v or f != "nomic_bert" or t == "MaskedLM"]  # NomicBERT's variant only unties the decoder


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family, task, variant", CASES,
                         ids=[f"{PREFIX[f]}For{t}" + ("-variant" if v else "") for f, t, v in CASES])
def test_head_matches_transformers(tmp_path, family, task, variant, backend):
    kw = dict(VARIANTS[family]) if variant else {}
    if task == "QuestionAnswering":
        kw["num_labels"] = 2
    model = build(family, f"{PREFIX[family]}For{task}", **kw)
    model.save_pretrained(tmp_path)  # NomicBERT and GTE files hold their authors' tensor names
    kwargs, mask = inputs_for(model, task == "MultipleChoice")
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    for source in (tmp_path, model):
        ours = load(source, backend=backend)
        assert isinstance(ours, TaskModel) and ours.architecture == type(model).__name__
        check_against(ours(**kwargs, output_hidden_states=True), ref, mask)


def test_every_transformers_head_of_the_families_is_listed():
    ours, names = set(supported_architectures()), dir(transformers)
    for family, prefix in PREFIX.items():
        if not hasattr(transformers, prefix + "Model"):
            continue
        theirs = {n for n in names if n.startswith(prefix + "For")}
        assert theirs | {prefix + "Model"} == set(supported_architectures(family)), family
        assert set(supported_architectures(family)) <= ours


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_multiple_choice_pools_the_first_real_token_under_left_padding(pooling):
    model = build("modernbert", "ModernBertForMultipleChoice", classifier_pooling=pooling)
    ids = torch.randint(3, 97, (2, 2, 12))
    mask = torch.ones(2, 2, 12, dtype=torch.long)
    mask[0, 1, :5] = 0  # left padded: transformers' "cls" is each row's first real token
    mask[1, 0, 7:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    assert rel_err(load(model, backend="torch")(ids, mask).logits, ref) <= 1e-5


def test_sequence_classification_and_left_padding():
    ids, mask = torch.randint(3, 97, (2, 12)), torch.tensor([[0] * 3 + [1] * 9, [1] * 12])
    mean = build("modernbert", "ModernBertForSequenceClassification", classifier_pooling="mean")
    with torch.no_grad():
        ref = mean(input_ids=ids, attention_mask=mask).logits
    assert rel_err(load(mean, backend="torch")(ids, mask).logits, ref) <= 1e-5  # pools real tokens only
    for family in ("modernbert", "nomic_bert"):  # reads position 0 (ModernBERT "cls", the pooler)
        ours = load(build(family, f"{PREFIX[family]}ForSequenceClassification"), backend="torch")
        with pytest.raises(ValueError, match="left padding"):
            ours(ids, mask)


def test_modernbert_takes_no_token_types():
    ours = load(build("modernbert", "ModernBertForTokenClassification"), backend="torch")
    ids = torch.randint(3, 97, (1, 5))
    with pytest.raises(ValueError, match="modernbert models have no token types"):
        ours(ids, token_type_ids=torch.zeros_like(ids))


# --- error paths --------------------------------------------------------------------------------


def _saved(tmp_path, family, task, drop=(), model_kw=None, **config_changes):
    """Save a task model, then remove tensors from its weights and change fields of its config."""
    from safetensors.torch import load_file, save_file

    build(family, f"{PREFIX[family]}For{task}", **(model_kw or {})).save_pretrained(tmp_path)
    if drop:
        tensors = load_file(tmp_path / "model.safetensors")
        assert all(name in tensors for name in drop), sorted(tensors)
        save_file({k: v for k, v in tensors.items() if k not in drop}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("family, task, drop, model_kw, changes, error, match", [
    ("modernbert", "SequenceClassification", (), None, {"classifier_pooling": "max"}, bertfast.LoadError,
     r"'classifier_pooling' = 'max' is not supported \(supported: 'cls', 'mean'\)"),
    ("modernbert", "TokenClassification", (), None, {"classifier_bias": "yes"}, bertfast.LoadError,
     "'classifier_bias' must be true or false"),
    ("modernbert", "TokenClassification", (), None, {"classifier_activation": "softmax"}, bertfast.LoadError,
     "activation 'softmax' is not supported"),
    ("modernbert", "TokenClassification", ["head.dense.bias"], {"classifier_bias": True}, {}, bertfast.LoadError,
     "'head.dense.bias'.*missing"),
    ("modernbert", "MaskedLM", ["decoder.weight"], {"tie_word_embeddings": False}, {}, bertfast.LoadError,
     "'decoder.weight'.*missing"),
    ("modernbert", "SequenceClassification", (), None, {"architectures": ["ModernBertForPreTraining"]},
     bertfast.LoadError, "'ModernBertForPreTraining'.*ModernBertForMaskedLM"),
    ("nomic_bert", "SequenceClassification", ["nomic_bert.pooler.dense.weight", "nomic_bert.pooler.dense.bias"],
     None, {}, bertfast.LoadError, "'nomic_bert.pooler.dense.weight'"),
    ("gte", "MaskedLM", ["lm_head.norm.weight"], None, {}, bertfast.LoadError,
     "'lm_head.layer_norm.weight'.*missing.*'lm_head.norm.weight'"),
    ("gte", "SequenceClassification", (), None, {"architectures": ["GteForQuestionAnswering"]}, bertfast.LoadError,
     "'GteForQuestionAnswering'.*GteForTokenClassification"),
    ("modernbert", "TokenClassification", (), None, {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, bertfast.ConfigError,
     "rope_parameters.full_attention.*rope_type 'yarn'"),
], ids=["pooling", "bias-flag", "classifier-activation", "classifier-bias", "untied-decoder", "architecture",
        "pooler", "gte-lm-norm", "gte-architecture", "yarn"])
def test_bad_checkpoints_name_the_field_or_tensor(tmp_path, family, task, drop, model_kw, changes, error, match):
    with pytest.raises(error, match=match):
        load(_saved(tmp_path, family, task, drop, model_kw, **changes), backend="torch")


def test_question_answering_needs_two_labels(tmp_path):
    with pytest.raises(bertfast.LoadError, match="num_labels is 3.*needs 2"):
        load(_saved(tmp_path, "modernbert", "TokenClassification", architectures=["ModernBertForQuestionAnswering"]),
             backend="torch")


# --- optimize -----------------------------------------------------------------------------------

MODELS = [(f, PREFIX[f] + c) for f in TASKS for c in ["Model"] + [f"For{t}" for t in TASKS[f]]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family, cls_name", MODELS, ids=[m[1] for m in MODELS])
def test_optimized_model_matches_original(family, cls_name, backend):
    kw = {"num_labels": 2} if "QuestionAnswering" in cls_name else {}
    model = build(family, cls_name, **kw)
    kwargs, mask = inputs_for(model, "MultipleChoice" in cls_name)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    keys_before = list(model.state_dict())
    assert bertfast.optimize(model, backend=backend, strict=True) is model
    assert type(model).__name__ == cls_name
    with torch.no_grad():
        out = model(**kwargs, output_hidden_states=True)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
    compare(out, ref, mask)
    assert list(model.state_dict()) == keys_before


def test_hidden_states_given_as_a_selection_fall_back():
    model = build("modernbert", "ModernBertModel")
    kwargs, mask = inputs_for(model)
    with torch.no_grad():
        selected = model(**kwargs, output_hidden_states=[0, -1]).hidden_states
    if len(selected) < 3 or selected[1] is not None or selected[-1] is None:  # 4.x: a list is True; 5.17: no last
        pytest.skip(f"transformers {transformers.__version__} does not select hidden states by index as 5.24 does")
    bertfast.optimize(model, backend="torch", strict=True)
    with pytest.raises(bertfast.EngineUnsupported, match="a selection"):
        model(**kwargs, output_hidden_states=[0, -1])
    bertfast.optimize(model, backend="torch")  # non-strict: the original modules answer
    with pytest.warns(UserWarning, match="a selection"), torch.no_grad():
        out = model(**kwargs, output_hidden_states=[0, -1]).hidden_states
    assert out[1] is None and rel_err(out[0], selected[0], mask) == 0 and rel_err(out[-1], selected[-1], mask) == 0


@pytest.mark.parametrize("major", [4, 5])
def test_the_last_state_before_the_final_norm_falls_back(major, monkeypatch):
    """transformers 5 gives the normed last state (as the engine) unless tie_last_hidden_states=False; transformers 4
    always the state before the norm. The engine serves only the first: whatever the version, never another answer."""
    monkeypatch.setattr(sys.modules["bertfast.optimize"], "_transformers_major", lambda: major)
    model = build("modernbert", "ModernBertModel")
    kwargs, mask = inputs_for(model)
    model.config.tie_last_hidden_states = False
    with torch.no_grad():
        untied = model(**kwargs, output_hidden_states=True).hidden_states
    bertfast.optimize(model, backend="torch", strict=True)
    with pytest.raises(bertfast.EngineUnsupported, match="tie_last_hidden_states=False"):
        model(**kwargs, output_hidden_states=True)
    del model.config.tie_last_hidden_states  # the default: tied in transformers 5, never in 4
    if major == 4:
        with pytest.raises(bertfast.EngineUnsupported, match="transformers 4's hidden states"):
            model(**kwargs, output_hidden_states=True)
    else:
        with torch.no_grad():
            model(**kwargs, output_hidden_states=True)
    with torch.no_grad():
        model(**kwargs)  # without hidden states either version is served
    model.config.tie_last_hidden_states = False
    bertfast.optimize(model, backend="torch")  # non-strict: the original modules answer
    with pytest.warns(UserWarning, match="tie_last_hidden_states"), torch.no_grad():
        out = model(**kwargs, output_hidden_states=True).hidden_states
    assert rel_err(out[-1], untied[-1], mask) == 0


def test_the_padded_shape_transformers_4_passes_is_served():
    """transformers 4's ModernBertFor* heads pass batch_size and seq_len (the padded input's shape) to the base."""
    model = build("modernbert", "ModernBertModel")
    kwargs, mask = inputs_for(model)
    batch, seq = kwargs["input_ids"].shape
    with torch.no_grad():
        ref = model(**kwargs).last_hidden_state
    bertfast.optimize(model, backend="torch", strict=True)
    with torch.no_grad():
        out = model(**kwargs, batch_size=batch, seq_len=seq).last_hidden_state
    assert rel_err(out, ref, mask) < 1e-5
    with pytest.raises(bertfast.EngineUnsupported, match="'seq_len' is set"):
        model(**kwargs, batch_size=batch, seq_len=seq + 1)


@pytest.mark.parametrize("family, cls_name, kw", [
    ("modernbert", "ModernBertForSequenceClassification", {}),  # classifier_pooling "cls": position 0
    ("modernbert", "ModernBertForMultipleChoice", {}),  # "cls": the first real token, served
    ("modernbert", "ModernBertForSequenceClassification", {"classifier_pooling": "mean"}),  # served
    ("nomic_bert", "NomicBertForSequenceClassification", {}),  # the pooler
], ids=["modernbert-cls", "modernbert-choice", "modernbert-mean", "nomic-pooler"])
def test_optimized_left_padding_gives_the_original_answer(family, cls_name, kw):
    """Heads reading position 0 get transformers' value there (computed for padding too): the original
    modules run; the others are served."""
    model = build(family, cls_name, **kw)
    ids, mask = torch.randint(3, 97, (4, 12)), torch.tensor([[0] * 3 + [1] * 9, [1] * 12] * 2)
    if "MultipleChoice" in cls_name:
        ids, mask = ids.view(2, 2, 12), mask.view(2, 2, 12)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    bertfast.optimize(model, backend="torch", strict=True)
    served = family == "modernbert" and ("mean" in kw.values() or "MultipleChoice" in cls_name)
    if not served:
        with pytest.raises(bertfast.EngineUnsupported, match="left padding"):
            model(input_ids=ids, attention_mask=mask)
        bertfast.optimize(model, backend="torch")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = model(input_ids=ids, attention_mask=mask).logits
    assert any("left padding" in str(w.message) for w in caught) != served
    assert rel_err(out, ref) <= 1e-5
