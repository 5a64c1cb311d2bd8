"""LoRA adapters on task models (`bertfast.load` -> `TaskModel.load_adapter`, `forward(adapter_ids=)`): an adapter's
LoRA runs in the encoder and its modules_to_save head tensors in the head, for its rows only.

- fp32 within 1e-5 (relative, padded positions excluded) of each adapter's own unmerged PeftModel forward on a ragged
  batch mixing four adapters (two SEQ_CLS / TOKEN_CLS with the classifier saved by default, one saving it by name,
  one encoder-only: the base head) and base rows: BERT sequence classification (pooler adapted) and token
  classification, on the cpu and torch backends; multiple choice with one adapter per example; masked LM with the
  whole MLM head saved (its decoder untied from the word embeddings).
- Batch invariance bit for bit on the cpu backend, in fp32, bf16 and int8: each row alone equals itself in a mixed
  batch of 481 tokens (past every row count of the GEMM choosers), sequence and token heads; base rows equal the
  forward without adapters.
- default_adapter, unload and reload, `bertfast.load(adapters=)`, a task adapter in a bare Encoder (its head tensors
  ignored: the encoder's outputs are the task model's, bit for bit).
- The errors: a saved tensor the head does not read, another num_labels, modules_to_save inside the encoder (task
  model and Encoder), nothing left loaded after any of them; adapter_ids of the wrong length.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder
from bertfast.adapters import UnknownAdapter
from bertfast.backends import available_backends
from bertfast.loading import LoadError
from conftest import rel_err
from helpers import families
from helpers.adapters import ALL_BERT, CASES as ADAPTER_CASES, LONG_LENGTHS, edited, save_lora
from helpers.heads import PREFIX, build as build_task
from helpers.modern_tasks import PREFIX as MODERN_PREFIX, build as build_modern

CPU_REASON = available_backends("cpu").get("cpu")
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

CLASSES = {"seq-cls": (transformers.BertForSequenceClassification, "SEQ_CLS"),
           "tok-cls": (transformers.BertForTokenClassification, "TOKEN_CLS")}
# name -> save_lora arguments past the task's: the classifier saved by PEFT's task default (a, b), by name (c), or
# not at all (d: the encoder's LoRA only, the base head).
ADAPTERS = {"a": dict(seed=1, r=4, lora_alpha=6, task=True),
            "b": dict(seed=2, r=3, lora_alpha=5, use_rslora=True, task=True),
            "c": dict(seed=3, r=2, lora_alpha=4, modules_to_save=["classifier"]),
            "d": dict(seed=4, r=4, lora_alpha=8)}
LENGTHS = [7, 1, 12, 5, 9, 3, 11, 4]
ROW_ADAPTERS = ["a", None, "b", "c", "d", None, "a", "d"]
# Over LONG_LENGTHS' 481 tokens (helpers.adapters), four adapters and the base model.
LONG_ADAPTERS = ["a", None, "b", "a", "c", None, "d", "b", "c", "a", None, "b", "d", "c", None, "a"]


def _task_model(cls, num_labels=3, seed=0):
    torch.manual_seed(seed)
    model = cls(transformers.BertConfig(**families.COMMON, num_labels=num_labels)).eval()
    with torch.no_grad():  # random init leaves LayerNorms at identity and biases at zero
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _save_adapter(model, path, task_type, seed, task=False, **lora):
    return save_lora(model, path, seed=seed, target_modules=ALL_BERT, task_type=task_type if task else None, **lora)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """case -> (transformers model, its checkpoint directory, {adapter: (PeftModel, directory)}), built once."""
    built = {}

    def get(case):
        if case not in built:
            cls, task_type = CLASSES[case]
            root = tmp_path_factory.mktemp(case)
            model = _task_model(cls)
            model.save_pretrained(root / "model")
            adapters = {n: (_save_adapter(model, root / n, task_type, **kw), root / n) for n, kw in ADAPTERS.items()}
            built[case] = (model, root / "model", adapters)
        return built[case]
    return get


def _load(path, adapters, backend="cpu", dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 measured slower on some tiers
        model = bertfast.load(path, backend=backend, dtype=dtype)
    for name, (_, adapter_path) in adapters.items():
        model.load_adapter(name, adapter_path)
    return model


def _reference(model, adapters, kwargs, row_adapters):
    """Each row's logits from its own adapter's PeftModel (the base model's for None rows)."""
    with torch.no_grad():
        outs = {name: pm(**kwargs).logits for name, (pm, _) in adapters.items()}
        outs[None] = model(**kwargs).logits
    return torch.stack([outs[a][i] for i, a in enumerate(row_adapters)])


def _backends():
    return [pytest.param(b, marks=needs_cpu) if b == "cpu" else b for b in ("cpu", "torch")]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", list(CLASSES))
def test_fp32_matches_each_peft_model(case, backend, task):
    model, path, adapters = task(case)
    kwargs, mask = families.batch_for(model, LENGTHS)
    ref = _reference(model, adapters, kwargs, ROW_ADAPTERS)
    ours = _load(path, adapters, backend)
    assert ours.adapters == list(ADAPTERS)
    assert sorted(ours._adapter_heads) == ["a", "b", "c"]  # d saved no head tensor: its rows run the base head
    logits = ours(**kwargs, adapter_ids=ROW_ADAPTERS).logits
    real = mask if logits.dim() == 3 else None
    assert rel_err(logits, ref, real) <= 1e-5
    with torch.no_grad():
        base = model(**kwargs).logits
    for i, a in enumerate(ROW_ADAPTERS):  # every adapter changes its rows
        row = slice(None) if real is None else slice(0, LENGTHS[i])
        if a is not None:
            assert rel_err(logits[i][row], base[i][row]) > 1e-2, f"row {i} ({a}) unchanged"


# The encoder linears each family's task adapter adapts: helpers.adapters' lists, DeBERTa-v2's without
# pos_key_proj (this config shares the keys) and with its head's ContextPooler (`dense`: `pooler.dense`, a head
# linear, merged into the adapter's copy of the head).
HEAD_TARGETS = {**{f: ADAPTER_CASES[f][1] for f in PREFIX if f in ADAPTER_CASES},
                "deberta-v2": ["query_proj", "key_proj", "value_proj", "dense"]}
TASK_TYPES = {"SequenceClassification": "SEQ_CLS", "TokenClassification": "TOKEN_CLS", "MaskedLM": None}
# (family, task, targets): every family's classifiers with its list; `all-linear` where PEFT builds it (not token
# classification, nor DistilBERT's sequence head: PEFT raises); masked LM heads whose transform dense is adapted (a
# head linear).
HEAD_CASES = ([(f, t, "family") for f in PREFIX for t in ("SequenceClassification", "TokenClassification")]
              + [(f, "SequenceClassification", "all-linear") for f in PREFIX if f != "distilbert"]
              + [("bert", "MaskedLM", ["query", "value", "dense"]), ("roberta", "MaskedLM", "all-linear")])


@needs_cpu
@pytest.mark.parametrize("family, task, targets", HEAD_CASES, ids=[f"{f}-{t}-{g if isinstance(g, str) else 'dense'}"
                                                                   for f, t, g in HEAD_CASES])
def test_every_family_task_adapter_matches_peft(family, task, targets, tmp_path):
    """A PEFT task adapter (SEQ_CLS / TOKEN_CLS: PEFT saves the head's modules by its suffix rule, DistilBERT's
    pre_classifier with its classifier; LoRA on a head's own linears merged into the adapter's head) on each family's
    task model: its rows within 1e-5 of the PeftModel, base rows the base model's."""
    model = build_task(family, task)
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=1, r=4, lora_alpha=6,
                   target_modules=HEAD_TARGETS[family] if targets == "family" else targets,
                   task_type=TASK_TYPES[task])
    kwargs, mask = families.batch_for(model, [7, 1, 12, 5])
    rows = ["a", None, "a", None]
    with torch.no_grad():
        ref, base = pm(**kwargs).logits, model(**kwargs).logits
    ours = _load(tmp_path / "model", {"a": (pm, tmp_path / "a")})
    assert sorted(ours._adapter_heads) == ["a"]
    logits = ours(**kwargs, adapter_ids=rows).logits
    real = mask if logits.dim() == 3 else None
    want = torch.stack([(ref if a else base)[i] for i, a in enumerate(rows)])
    assert rel_err(logits, want, real) <= 1e-5
    assert rel_err(logits[0], base[0], None if real is None else real[0]) > 1e-2  # the adapter changes its rows


MODERN_CASES = [(f, t, g) for f in MODERN_PREFIX for t in ("SequenceClassification", "MaskedLM")
                for g in ("family", "all-linear")]


@needs_cpu
@pytest.mark.parametrize("family, task, targets", MODERN_CASES, ids=[f"{f}-{t}-{g}" for f, t, g in MODERN_CASES])
def test_rotary_family_task_adapter_matches_peft(family, task, targets, tmp_path):
    """ModernBERT, NomicBERT and GTE task models with a PEFT adapter (all-linear reaching the head's dense: merged
    into the adapter's head): within 1e-5 of the PeftModel."""
    model = build_modern(family, MODERN_PREFIX[family] + "For" + task)
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=1, r=4, lora_alpha=6, task_type=TASK_TYPES[task],
                   target_modules=ADAPTER_CASES[family][1] if targets == "family" else targets)
    kwargs, mask = families.batch_for(model, [7, 1, 12, 5])
    with torch.no_grad():
        ref = pm(**kwargs).logits
    ours = _load(tmp_path / "model", {"a": (pm, tmp_path / "a")})
    logits = ours(**kwargs, adapter_ids=["a"] * 4).logits
    assert rel_err(logits, ref, mask if logits.dim() == 3 else None) <= 1e-5


@needs_cpu
def test_head_lora_is_the_heads_own(tmp_path):
    """LoRA on a head's linear lives in the adapter's copy of the head: a bare Encoder ignores it (its outputs equal
    the task model's encoder outputs), stacking refuses it, and a factor on a linear the head lacks is refused
    naming it, leaving nothing loaded."""
    model = build_task("bert", "MaskedLM")
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=1, r=4, lora_alpha=6, target_modules=["query", "value", "dense"])
    kwargs, _ = families.batch_for(model, LENGTHS)
    ours = _load(tmp_path / "model", {"a": (pm, tmp_path / "a")})
    assert sorted(ours.encoder._adapter("a").head_lora) == ["cls.predictions.transform.dense"]
    enc = Encoder.from_pretrained(tmp_path / "model", backend="cpu", dtype=torch.float32)
    enc.load_adapter("a", tmp_path / "a")
    rows = ["a", None] * (len(LENGTHS) // 2)
    assert torch.equal(enc(**kwargs, adapter_ids=rows).last_hidden_state,
                       ours(**kwargs, adapter_ids=rows).last_hidden_state)
    with pytest.raises(LoadError, match=r"LoRA of a head \(cls\.predictions\.transform\.dense\)"):
        enc.load_adapter("twice", [tmp_path / "a", tmp_path / "a"])
    bogus = edited(tmp_path / "a", tmp_path / "bogus",
                   tensors={"base_model.model.cls.bogus.dense.lora_A.weight": torch.zeros(4, 64),
                            "base_model.model.cls.bogus.dense.lora_B.weight": torch.zeros(64, 4)})
    with pytest.raises(LoadError, match=r"LoRA of 'cls\.bogus\.dense' \(64 x 64\) does not fit a linear the "
                                        r"BertForMaskedLM head reads"):
        ours.load_adapter("x", bogus)
    assert ours.adapters == ["a"] and list(ours._adapter_heads) == ["a"]


@needs_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"], ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", list(CLASSES))
def test_row_alone_equals_row_in_mixed_batch(case, dtype, task):
    model, path, adapters = task(case)
    kwargs, mask = families.batch_for(model, LONG_LENGTHS, seed=3)
    lengths = mask.sum(1).tolist()
    assert int(mask.sum()) > 256
    ours = _load(path, adapters, dtype=dtype)
    together = ours(**kwargs, adapter_ids=LONG_ADAPTERS).logits
    plain = ours(**kwargs).logits
    for b, n in enumerate(lengths):
        row = {k: v[b:b + 1, :n] for k, v in kwargs.items() if k != "attention_mask"}
        alone = ours(**row, adapter_ids=[LONG_ADAPTERS[b]]).logits[0]
        want = together[b] if together.dim() == 2 else together[b, :n]
        assert torch.equal(alone, want), f"row {b} ({n} tokens, {LONG_ADAPTERS[b]}) differs alone"
        if LONG_ADAPTERS[b] is None:
            base = plain[b] if plain.dim() == 2 else plain[b, :n]
            assert torch.equal(want, base), f"base row {b} differs from the forward without adapters"


@needs_cpu
def test_multiple_choice_one_adapter_per_example(tmp_path):
    model = _task_model(transformers.BertForMultipleChoice)
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=5, r=4, lora_alpha=6, target_modules=ALL_BERT,
                   modules_to_save=["classifier"])
    flat, _ = families.batch_for(model, [7, 3, 9, 5, 2, 8])
    kwargs = {k: v.view(2, 3, -1) for k, v in flat.items()}
    with torch.no_grad():
        ref = torch.stack([pm(**kwargs).logits[0], model(**kwargs).logits[1]])
    ours = bertfast.load(tmp_path / "model", backend="cpu", dtype=torch.float32, adapters={"a": tmp_path / "a"})
    assert rel_err(ours(**kwargs, adapter_ids=["a", None]).logits, ref) <= 1e-5
    with pytest.raises(ValueError, match="3 entries for 2 examples"):
        ours(**kwargs, adapter_ids=["a", None, None])


@needs_cpu
def test_question_answering_adapter(tmp_path):
    """PEFT's QUESTION_ANS task saves `qa_outputs` whole: each row's start and end logits from its own adapter's
    PeftModel (two adapters and base rows in one batch), a row alone the bits it has in the batch."""
    model = _task_model(transformers.BertForQuestionAnswering, num_labels=2)
    model.save_pretrained(tmp_path / "model")
    pms = {n: save_lora(model, tmp_path / n, seed=7 + i, r=4, lora_alpha=6, target_modules=ALL_BERT,
                        task_type="QUESTION_ANS") for i, n in enumerate(("a", "b"))}
    rows = ["a", None, "b", "a"]
    kwargs, mask = families.batch_for(model, [6, 3, 9, 4])
    kwargs.pop("token_type_ids")  # PeftModelForQuestionAnswering.forward does not pass them on (zeros either way)
    with torch.no_grad():
        outs = {n: pm(**kwargs) for n, pm in pms.items()}
        outs[None] = model(**kwargs)
    ours = bertfast.load(tmp_path / "model", backend="cpu", dtype=torch.float32,
                         adapters={n: tmp_path / n for n in pms})
    assert sorted(ours._adapter_heads) == ["a", "b"]
    got = ours(**kwargs, adapter_ids=rows)
    for field in ("start_logits", "end_logits"):
        ref = torch.stack([getattr(outs[a], field)[i] for i, a in enumerate(rows)])
        assert rel_err(getattr(got, field), ref, mask) <= 1e-5
    alone = ours(**{k: v[2:3, :9] for k, v in kwargs.items()}, adapter_ids=["b"])
    assert torch.equal(alone.start_logits[0], got.start_logits[2, :9])


@needs_cpu
def test_masked_lm_saved_decoder(tmp_path):
    """modules_to_save=["cls"]: PEFT's copy of the MLM head unties the decoder from the word embeddings and saves
    both of transformers' names of its bias; the adapter's rows run that copy, the base rows the tied decoder."""
    model = _task_model(transformers.BertForMaskedLM)
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=6, r=4, lora_alpha=6, target_modules=["query", "value"],
                   modules_to_save=["cls"])
    kwargs, mask = families.batch_for(model, [5, 3, 7])
    ref = _reference(model, {"a": (pm, None)}, kwargs, ["a", None, "a"])
    ours = bertfast.load(tmp_path / "model", backend="cpu", dtype=torch.float32, adapters={"a": tmp_path / "a"})
    head, word = ours._adapter_heads["a"], ours.encoder.engine.weights.embeddings.word
    assert ours.head.tensors["cls.predictions.decoder.weight"] is word
    assert head.tensors["cls.predictions.decoder.weight"] is not word
    assert head.tensors["cls.predictions.bias"] is head.tensors["cls.predictions.decoder.bias"]
    assert rel_err(ours(**kwargs, adapter_ids=["a", None, "a"]).logits, ref, mask) <= 1e-5


@needs_cpu
def test_default_adapter_unload_and_reload(task):
    model, path, adapters = task("seq-cls")
    kwargs, _ = families.batch_for(model, LENGTHS)
    ours = bertfast.load(path, backend="cpu", dtype=torch.float32, adapters={"a": adapters["a"][1]})
    assert isinstance(ours, bertfast.TaskModel) and ours.adapters == ["a"]
    base = ours(**kwargs).logits
    named = ours(**kwargs, adapter_ids=["a"] * len(LENGTHS)).logits
    ours.default_adapter = "a"
    assert ours.encoder.default_adapter == "a"
    assert torch.equal(ours(**kwargs).logits, named)
    assert torch.equal(ours(**kwargs, adapter_ids=[None] * len(LENGTHS)).logits, base)
    with pytest.raises(ValueError, match="default_adapter"):
        ours.unload_adapter("a")
    ours.default_adapter = None
    ours.unload_adapter("a")
    assert ours.adapters == [] and not ours._adapter_heads
    with pytest.raises(UnknownAdapter, match="no adapter named 'a' is loaded"):
        ours(**kwargs, adapter_ids=["a"] * len(LENGTHS))
    with pytest.raises(ValueError, match="one adapter name or None per row"):
        ours(**kwargs, adapter_ids="a")
    with pytest.raises(ValueError, match="2 entries for 8 rows"):
        ours(**kwargs, adapter_ids=["a", None])
    ours.load_adapter("a", adapters["b"][1])  # the name is free again: another adapter under it
    assert torch.equal(ours(**kwargs, adapter_ids=["a"] * len(LENGTHS)).logits,
                       _load(path, {"b": adapters["b"]})(**kwargs, adapter_ids=["b"] * len(LENGTHS)).logits)


@needs_cpu
def test_task_adapter_in_a_bare_encoder(task):
    """An Encoder returns the encoder's outputs, which a task adapter's head tensors do not change (PEFT runs them
    after the encoder): it loads the LoRA and ignores them, the same bits as the task model's encoder."""
    model, path, adapters = task("seq-cls")
    kwargs, _ = families.batch_for(model, LENGTHS)
    enc = Encoder.from_pretrained(path, backend="cpu", dtype=torch.float32)
    enc.load_adapter("a", adapters["a"][1])
    ours = _load(path, {"a": adapters["a"]})
    rows = ["a", None] * (len(LENGTHS) // 2)
    out, task_out = enc(**kwargs, adapter_ids=rows), ours(**kwargs, adapter_ids=rows)
    assert torch.equal(out.last_hidden_state, task_out.last_hidden_state)
    via = bertfast.load(path, backend="cpu", dtype=torch.float32, architecture="BertModel",
                        adapters={"a": adapters["a"][1]})
    assert isinstance(via, Encoder) and torch.equal(via(**kwargs, adapter_ids=rows).pooler_output, out.pooler_output)


@needs_cpu
def test_bad_head_tensors_are_refused(task, tmp_path):
    model, path, adapters = task("seq-cls")
    ours = _load(path, {"a": adapters["a"]})
    extra = edited(adapters["a"][1], tmp_path / "extra", config={"modules_to_save": ["classifier", "scorer"]},
                   tensors={"base_model.model.scorer.weight": torch.zeros(3, 64)})
    lacks = (r"'base_model\.model\.scorer\.weight' \(modules_to_save\) is not one the BertForSequenceClassification "
             r"head reads \(classifier\.bias, classifier\.weight\)")
    with pytest.raises(LoadError, match=lacks):
        ours.load_adapter("x", extra)
    five = _task_model(transformers.BertForSequenceClassification, num_labels=5)
    five.bert.load_state_dict(model.bert.state_dict())  # the same encoder, a head of 5 labels
    save_lora(five, tmp_path / "five", r=2, lora_alpha=2, target_modules=ALL_BERT, task_type="SEQ_CLS")
    with pytest.raises(LoadError, match=r"'base_model\.model\.classifier\.bias' \(modules_to_save\) has shape \(5,\), "
                                        r"the BertForSequenceClassification head's 'classifier\.bias' has \(3,\): "
                                        r"the adapter was trained for another head \(num_labels\?\)"):
        ours.load_adapter("x", tmp_path / "five")
    pooler = _save_adapter(model, tmp_path / "pooler", "SEQ_CLS", seed=6, task=True, r=2, lora_alpha=2,
                           modules_to_save=["pooler"])
    assert any(".modules_to_save." in n for n, _ in pooler.named_parameters() if "pooler" in n)
    encoder_copy = r"'base_model\.model\.bert\.pooler\.dense\.bias': modules_to_save wraps a module of the encoder"
    with pytest.raises(LoadError, match=encoder_copy):
        ours.load_adapter("x", tmp_path / "pooler")
    with pytest.raises(LoadError, match=encoder_copy):
        Encoder.from_pretrained(path, backend="cpu").load_adapter("x", tmp_path / "pooler")
    assert ours.adapters == ["a"] and list(ours._adapter_heads) == ["a"]  # nothing of "x" stayed
    base_model = families.build("bert")  # a base model's adapter: everything it saves is inside the encoder
    save_lora(base_model, tmp_path / "base-pooler", r=2, lora_alpha=2, target_modules=ALL_BERT,
              modules_to_save=["pooler"])
    enc = Encoder.from_hf(base_model, backend="cpu")
    with pytest.raises(LoadError, match=r"'base_model\.model\.pooler\.dense\.bias': modules_to_save wraps a module"):
        enc.load_adapter("x", tmp_path / "base-pooler")
    assert enc.adapters == []
