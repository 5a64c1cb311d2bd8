"""Task heads: `load(dir or model)` against the transformers task model, for every family and head."""

import json

import pytest
import torch
import transformers

import bertfast
from bertfast.heads import TaskModel, load, supported_architectures
from conftest import rel_err
from helpers.families import COMMON, CPU_BACKENDS, batch_for
from helpers.heads import PREFIX, build
from helpers.outputs import check_against


TASKS = {
    "bert": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice", "MaskedLM",
             "NextSentencePrediction", "PreTraining"],
    "roberta": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice", "MaskedLM"],
    "electra": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice", "MaskedLM",
                "PreTraining"],
    "albert": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice", "MaskedLM",
               "PreTraining"],
    "distilbert": ["SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice",
                   "MaskedLM"],
}
TASKS["xlm-roberta"] = TASKS["mpnet"] = TASKS["deberta-v2"] = TASKS["roberta"]


def inputs_for(model, task):
    """Ragged batch (lengths 40, 1, 9, 23, 5, 17); multiple choice: 3 questions x 2 choices."""
    kwargs, mask = batch_for(model, [40, 1, 9, 23, 5, 17], seed=4)
    if task == "MultipleChoice":
        kwargs = {k: v.view(3, 2, -1) for k, v in kwargs.items()}
    return kwargs, mask


CASES = [(f, t, True) for f in TASKS for t in TASKS[f]] + [
    # Untied decoders: the checkpoint's own decoder weight and bias, not the embeddings'.
    (f, t, False) for f, t in [("bert", "PreTraining"), ("roberta", "MaskedLM"), ("electra", "MaskedLM"),
                               ("albert", "MaskedLM"), ("distilbert", "MaskedLM"), ("mpnet", "MaskedLM"),
                               ("deberta-v2", "MaskedLM")]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family, task, tied", CASES,
                         ids=[f"{PREFIX[f]}For{t}" + ("" if tied else "-untied") for f, t, tied in CASES])
def test_head_matches_transformers(tmp_path, family, task, tied, backend):
    model = build(family, task, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    kwargs, mask = inputs_for(model, task)
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    for source in (tmp_path, model):  # from the saved directory and from the in-memory model
        ours = load(source, backend=backend)
        assert isinstance(ours, TaskModel) and ours.architecture == type(model).__name__
        check_against(ours(**kwargs, output_hidden_states=True), ref, mask)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_deberta_mlm_head_not_legacy(tmp_path, backend):
    """DeBERTa-v2's legacy=False MLM head (DebertaV2LMPredictionHead: its own names, the word embeddings)."""
    model = build("deberta-v2", "MaskedLM", legacy=False)
    model.save_pretrained(tmp_path)
    kwargs, mask = inputs_for(model, "MaskedLM")
    with torch.no_grad():
        ref = model(**kwargs, output_hidden_states=True)
    for source in (tmp_path, model):
        check_against(load(source, backend=backend)(**kwargs, output_hidden_states=True), ref, mask)


def test_outputs_without_hidden_states_and_as_tuple():
    model = build("bert", "QuestionAnswering")
    kwargs, mask = inputs_for(model, "QuestionAnswering")
    with torch.no_grad():
        ref = model(**kwargs)
    ours = load(model, backend="torch")
    out = ours(**kwargs)
    assert out.keys() == ["start_logits", "end_logits", "last_hidden_state"] and out.hidden_states is None
    start, end, _ = ours(**kwargs, return_dict=False)
    assert rel_err(start, ref.start_logits, mask) <= 1e-5 and rel_err(end, ref.end_logits, mask) <= 1e-5


def test_every_transformers_head_of_the_families_is_listed():
    ours, names = set(supported_architectures()), dir(transformers)
    for family, prefix in PREFIX.items():
        theirs = {n for n in names if n.startswith(prefix + "For") and not n.endswith("CausalLM")}
        assert theirs | {prefix + "Model"} == {a for a in ours if a.startswith(prefix) and
                                               (a.startswith(prefix + "For") or a == prefix + "Model")}, family


@pytest.mark.parametrize("family, task", [
    ("bert", "SequenceClassification"), ("roberta", "SequenceClassification"),  # pooler, token 0 + dense
    ("distilbert", "SequenceClassification"), ("bert", "TokenClassification"),  # token 0 + relu, per token
    ("bert", "MaskedLM")])  # per token: dense, GELU, LayerNorm, decoder
def test_heads_are_batch_invariant(family, task):
    """A row's logits alone equal its logits inside a ragged batch, bit for bit (the GEMM library picks
    its kernel by row count, so the head runs row by row, per-token steps sequence by sequence)."""
    model = build(family, task)
    kwargs, mask = inputs_for(model, task)
    ours = load(model, backend="cpu" if "cpu" in CPU_BACKENDS else "torch")
    batch = ours(**kwargs).logits
    for i, n in enumerate(mask.sum(1).tolist()):
        alone = ours(**{k: v[i:i + 1, :n] for k, v in kwargs.items()}).logits
        want = batch[i] if batch.dim() == 2 else batch[i, :n]
        assert torch.equal(alone[0], want), i


@pytest.mark.parametrize("num_labels, problem_type, multi", [
    (3, None, False), (3, "single_label_classification", False), (3, "multi_label_classification", True),
    (1, None, True)])
def test_labels_and_scores(tmp_path, num_labels, problem_type, multi):
    """labels follow id2label (index order); scores are transformers' pipeline rule: sigmoid for one label
    or multi-label problems, softmax otherwise."""
    names = {i: f"name{i}" for i in range(num_labels)}
    model = build("bert", "SequenceClassification", num_labels=num_labels, id2label=names, problem_type=problem_type)
    model.save_pretrained(tmp_path)
    for source in (tmp_path, model):
        ours = load(source, backend="torch")
        assert ours.labels == [names[i] for i in range(num_labels)] and ours.multi_label is multi
        logits = torch.randn(4, num_labels, dtype=torch.float64)
        expect = torch.sigmoid(logits) if multi else torch.softmax(logits, -1)
        got = ours.scores(logits)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), expect, atol=1e-7)
        # batch-invariant: a row's scores alone are the same bits as in a batch (elementwise kernels take
        # vector or scalar paths by position, so a row at the tail of a batch could round differently)
        many = torch.randn(4096, num_labels) * 4
        rows = torch.cat([ours.scores(many[i:i + 1]) for i in range(len(many))])
        assert torch.equal(ours.scores(many), rows)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["id2label"], cfg["label2id"]
    cfg["num_labels"] = num_labels
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load(tmp_path, backend="torch").labels == [f"LABEL_{i}" for i in range(num_labels)]
    assert load(build("bert", "MaskedLM"), backend="torch").labels is None


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="int8 needs the cpu backend (bertfast._C)")
def test_int8_dtype_quantizes_the_encoder(tmp_path):
    """dtype="int8" works in `load` as in `Encoder.from_pretrained`: the same quantized encoder, bit for bit."""
    model = build("bert", "SequenceClassification")
    model.save_pretrained(tmp_path)
    kwargs, mask = inputs_for(model, "SequenceClassification")
    ours = load(tmp_path, backend="cpu", dtype="int8")
    assert ours.encoder.quantize == "int8" and ours.encoder.dtype == torch.float32
    plain = bertfast.Encoder.from_pretrained(tmp_path, backend="cpu", dtype="int8")
    assert torch.equal(ours.encoder(**kwargs).pooler_output, plain(**kwargs).pooler_output)
    assert ours(**kwargs).logits.shape == (6, 3)


def test_per_token_heads_accept_left_padding():
    model = build("bert", "TokenClassification")
    ids = torch.randint(1, 97, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    out = load(model, backend="torch")(ids, mask).logits
    assert rel_err(out, ref, mask) <= 1e-5


def test_first_token_heads_reject_left_padding():
    ours = load(build("roberta", "SequenceClassification"), backend="torch")
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match=r"left padding.*RobertaForSequenceClassification"):
        ours(torch.full((2, 3), 5), mask)


def test_multiple_choice_needs_three_dim_inputs():
    ours = load(build("bert", "MultipleChoice"), backend="torch")
    with pytest.raises(ValueError, match="num_choices"):
        ours(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        ours(torch.ones(2, 3, 5, dtype=torch.long), torch.ones(6, 5, dtype=torch.long))


def test_base_architectures_give_an_encoder(tmp_path):
    transformers.BertModel(transformers.BertConfig(**COMMON)).save_pretrained(tmp_path)
    assert isinstance(load(tmp_path, backend="torch"), bertfast.Encoder)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load(tmp_path, backend="torch"), bertfast.Encoder)


def test_architecture_override(tmp_path):
    build("bert", "PreTraining").save_pretrained(tmp_path)
    ref_model = transformers.BertForMaskedLM.from_pretrained(tmp_path).eval()
    kwargs, mask = inputs_for(ref_model, "MaskedLM")
    with torch.no_grad():
        ref = ref_model(**kwargs).logits
    ours = load(tmp_path, backend="torch", architecture="BertForMaskedLM")
    assert rel_err(ours(**kwargs).logits, ref, mask) <= 1e-5


# --- error paths --------------------------------------------------------------------------------


def _saved(tmp_path, family, task, drop=(), **config_changes):
    """Save a task model, then remove tensors from its weights and change fields of its config."""
    from safetensors.torch import load_file, save_file

    build(family, task).save_pretrained(tmp_path)
    if drop:
        tensors = load_file(tmp_path / "model.safetensors")
        assert all(name in tensors for name in drop)
        save_file({k: v for k, v in tensors.items() if k not in drop}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("arch, family", [("BertForFancyTask", "bert"), ("RobertaForNextSentencePrediction", "roberta"),
                                          ("RobertaForMaskedLM", "bert"), ("DistilBertForPreTraining", "distilbert")])
def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, arch, family):
    path = _saved(tmp_path, family, "SequenceClassification", architectures=[arch])
    prefix = PREFIX[family]
    with pytest.raises(bertfast.LoadError, match=rf"{arch}.*{family}.*{prefix}ForSequenceClassification"):
        load(path, backend="torch")


def test_unsupported_in_memory_class_is_named():
    model = transformers.BertLMHeadModel(transformers.BertConfig(**COMMON))
    with pytest.raises(bertfast.LoadError, match="BertLMHeadModel.*BertForMaskedLM"):
        load(model, backend="torch")


@pytest.mark.parametrize("family, task, drop, match", [
    ("bert", "SequenceClassification", ["classifier.weight"], "'classifier.weight'.*missing"),
    ("roberta", "SequenceClassification", ["classifier.out_proj.bias"], "'classifier.out_proj.bias'.*missing"),
    ("bert", "MultipleChoice", ["bert.pooler.dense.weight", "bert.pooler.dense.bias"], "'bert.pooler.dense.weight'"),
    ("albert", "MaskedLM", ["predictions.bias"], "'predictions.bias'.*missing"),
    ("electra", "PreTraining", ["discriminator_predictions.dense_prediction.weight"], "dense_prediction.weight"),
], ids=["classifier", "roberta-out-proj", "pooler", "mlm-bias", "electra-discriminator"])
def test_missing_head_tensor_is_named(tmp_path, family, task, drop, match):
    with pytest.raises(bertfast.LoadError, match=match):
        load(_saved(tmp_path, family, task, drop=drop), backend="torch")


def test_untied_decoder_weight_is_required(tmp_path):
    from safetensors.torch import load_file, save_file

    build("distilbert", "MaskedLM", tie_word_embeddings=False).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["vocab_projector.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(bertfast.LoadError, match="'vocab_projector.weight'.*missing"):
        load(tmp_path, backend="torch")


def test_head_tensor_of_wrong_shape_is_named(tmp_path):
    path = _saved(tmp_path, "bert", "TokenClassification", id2label={str(i): f"L{i}" for i in range(5)})
    with pytest.raises(bertfast.LoadError, match=r"'classifier.weight' has shape \(3, 64\), expected \(5, 64\)"):
        load(path, backend="torch")


def test_question_answering_needs_two_labels(tmp_path):
    path = _saved(tmp_path, "bert", "SequenceClassification", architectures=["BertForQuestionAnswering"])
    with pytest.raises(bertfast.LoadError, match="num_labels is 3.*needs 2"):
        load(path, backend="torch")


def test_electra_summary_reading_padding_is_rejected(tmp_path):
    path = _saved(tmp_path, "electra", "MultipleChoice", summary_type="last")
    with pytest.raises(bertfast.LoadError, match="summary_type.*'last'"):
        load(path, backend="torch")


def test_not_a_model(tmp_path):
    with pytest.raises(bertfast.LoadError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(bertfast.LoadError, match="expected a model directory"):
        load(42)
