"""`bertfast.optimize(peft_model)`: a LoRA PeftModel served with its active adapter, unmerged or merged.

- fp32 within 1e-5 (relative, padded positions excluded) of the PeftModel's own forward, on every family's random
  base model (helpers.adapters.CASES: its targets) and a BERT sequence classifier (PEFT's SEQ_CLS: the classifier
  in modules_to_save, run by PEFT in torch), unmerged (the PeftModel returned, its base served with the adapter as
  `Encoder.default_adapter`) and with merge=True (a merged copy returned, the PeftModel's state dict and classes
  unchanged).
- `Encoder.default_adapter`: every row gets it when the call names none, bit for bit as when named per row; an
  explicit adapter_ids with None rows gives base rows; it is validated and cannot be unloaded while set.
- A call the engine cannot serve with the adapter (`disable_adapter()`) runs the original modules after a warning.
- Several active adapters (PEFT sums their deltas): served stacked as one, unmerged and merged, within 1e-5;
  `Encoder.load_adapter(name, [dirs])` the same, and its errors.
- The errors: DoRA, another peft_type, unmerged: an adapter merged already or a modules_to_save inside the encoder;
  merge=True without a PeftModel.
- A SentenceTransformer whose Transformer's model has the adapter (transformers' PEFT integration: `add_adapter`,
  `load_adapter` of a saved PEFT directory, a saved SentenceTransformer with its adapter; or a PeftModel put in its
  place): `encode` within 1e-5 (relative) of its own, unmerged and merged (the original unchanged; merged also
  once served unmerged); each text's token embeddings and embedding alone equal to themselves in a batch of over
  256 tokens, bit for bit; a disabled or switched adapter runs the original modules; two active adapters served as
  their sum; the errors (merge=True disabled or without adapter, DoRA: the SentenceTransformer's warning, or
  EngineUnsupported under strict).
"""

from __future__ import annotations

import os
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download; set before the hub libraries load

import peft
import pytest
import sentence_transformers as st
import torch
import transformers
from packaging.version import Version

import bertfast
from bertfast import Encoder
from bertfast.adapters import UnknownAdapter
from bertfast.loading import LoadError
from conftest import rel_err
from helpers import families
from helpers.adapters import CASES, randomize, save_lora
from helpers.sentences import sentences

try:
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
except ImportError:  # releases before 6.0
    from sentence_transformers.models import Normalize, Pooling, Transformer

LENGTHS = [7, 1, 12, 5]
TARGETS = CASES["bert"][1]


def _classifier():
    return transformers.BertForSequenceClassification(transformers.BertConfig(**families.COMMON, num_labels=3)).eval()


# Every family's base model (its adapter's targets: helpers.adapters.CASES), and BERT's sequence classifier.
MODELS = {**{name: (lambda build=build: build().eval()) for name, (build, _) in CASES.items()},
          "bert-seq-cls": _classifier}
TASK = {"bert-seq-cls": "SEQ_CLS"}


def _peft(name, tmp_path, **lora):
    model = MODELS[name]()
    targets = CASES[name][1] if name in CASES else TARGETS
    return model, save_lora(model, tmp_path / "a", r=4, lora_alpha=6, target_modules=targets,
                            task_type=TASK.get(name), **lora)


def _output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _compare(ours, ref, mask):
    if ours.dim() == 3:
        return rel_err(ours, ref, mask)
    return rel_err(ours, ref)


def _served(pm) -> bool:
    return hasattr(pm.get_base_model().base_model, "_bertfast_encoder")


@pytest.mark.parametrize("name", list(MODELS))
def test_unmerged_matches_peft(name, tmp_path):
    model, pm = _peft(name, tmp_path)
    kwargs, mask = families.batch_for(model, LENGTHS)
    with torch.no_grad():
        ref, base = _output(pm(**kwargs)), _output(model(**kwargs))
        assert bertfast.optimize(pm) is pm
        assert _served(pm) and pm.get_base_model().base_model._bertfast_encoder.default_adapter == "default"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the engine serves the call: no fallback
            ours = _output(pm(**kwargs))
    assert _compare(ours, ref, mask) <= 1e-5
    assert _compare(ours, base, mask) > 1e-2  # the adapter does change the output


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_matches_peft_and_leaves_the_peft_model(name, tmp_path):
    model, pm = _peft(name, tmp_path)
    kwargs, mask = families.batch_for(model, LENGTHS)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with torch.no_grad():
        ref = _output(pm(**kwargs))
        merged = bertfast.optimize(pm, merge=True)
        assert not isinstance(merged, peft.PeftModel) and hasattr(merged.base_model, "_bertfast_encoder")
        ours = _output(merged(**kwargs))
        again = _output(pm(**kwargs))
    assert _compare(ours, ref, mask) <= 1e-5
    after = pm.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert not _served(pm)
    assert not any(m.merged for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    assert torch.equal(again, ref)


def test_default_adapter_every_row_and_explicit_base_rows(tmp_path):
    model, _ = _peft("bert", tmp_path)
    kwargs, mask = families.batch_for(model, LENGTHS)
    enc = Encoder.from_hf(model, dtype=torch.float32)
    enc.load_adapter("a", tmp_path / "a")
    assert enc.default_adapter is None
    base = enc(**kwargs).last_hidden_state
    named = enc(**kwargs, adapter_ids=["a"] * len(LENGTHS)).last_hidden_state
    enc.default_adapter = "a"
    assert torch.equal(enc(**kwargs).last_hidden_state, named)
    assert torch.equal(enc(**kwargs, adapter_ids=[None] * len(LENGTHS)).last_hidden_state, base)
    mixed = enc(**kwargs, adapter_ids=[None, "a", None, "a"]).last_hidden_state
    for row, want in enumerate((base, named, base, named)):
        n = LENGTHS[row]
        assert torch.equal(mixed[row, :n], want[row, :n])
    with pytest.raises(UnknownAdapter, match="'zzz'"):
        enc.default_adapter = "zzz"
    assert enc.default_adapter == "a"
    with pytest.raises(ValueError, match="default_adapter"):
        enc.unload_adapter("a")
    enc.default_adapter = None
    enc.unload_adapter("a")
    assert torch.equal(enc(**kwargs).last_hidden_state, base)


def test_disabled_adapter_runs_the_original_modules(tmp_path):
    model, pm = _peft("bert", tmp_path)
    kwargs, mask = families.batch_for(model, LENGTHS)
    with torch.no_grad():
        base = model(**kwargs).last_hidden_state
        bertfast.optimize(pm)
        with pm.disable_adapter(), pytest.warns(UserWarning, match="disable_adapter"):
            off = pm(**kwargs).last_hidden_state
    assert rel_err(off, base, mask) <= 1e-6


def _two_active(tmp_path):
    """A BERT PeftModel with adapters "default" (every target, r 4) and "b" (query and the denses, r 3, rsLoRA), both
    active (PEFT sums their deltas), and the output with "default" alone."""
    model, pm = _peft("bert", tmp_path)
    save_lora(model, tmp_path / "b", seed=1, r=3, lora_alpha=5, use_rslora=True, target_modules=["query", "dense"])
    pm.load_adapter(tmp_path / "b", adapter_name="b")
    kwargs, mask = families.batch_for(model, LENGTHS)
    with torch.no_grad():
        one = pm(**kwargs).last_hidden_state
    pm.base_model.set_adapter(["default", "b"])
    return model, pm, kwargs, mask, one


def test_several_active_adapters_served_as_their_sum(tmp_path):
    """Two active adapters served stacked as one ("default+b"), unmerged and merged, within 1e-5 of PEFT's sum; back
    to one active adapter, the engine steps aside (the original modules run)."""
    model, pm, kwargs, mask, one = _two_active(tmp_path)
    with torch.no_grad():
        ref = pm(**kwargs).last_hidden_state
        merged = bertfast.optimize(pm, merge=True)
        assert rel_err(merged(**kwargs).last_hidden_state, ref, mask) <= 1e-5
        assert bertfast.optimize(pm) is pm and _served(pm)
        assert pm.get_base_model().base_model._bertfast_encoder.default_adapter == "default+b"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the engine serves the call: no fallback
            ours = pm(**kwargs).last_hidden_state
        assert rel_err(ours, ref, mask) <= 1e-5
        assert rel_err(ref, one, mask) > 1e-2  # "b" does change the output
        pm.base_model.set_adapter("default")
        with pytest.warns(UserWarning, match=r"no longer \['default', 'b'\]"):
            assert torch.equal(pm(**kwargs).last_hidden_state, one)


def test_encoder_loads_a_list_of_adapters_as_their_sum(tmp_path):
    """`Encoder.load_adapter(name, [dir, dir])`: PEFT's two active adapters within 1e-5, each row alone bit for bit
    as in the batch; the errors: an empty list, a list with a task adapter's head tensors (nothing loaded)."""
    model, pm, kwargs, mask, _ = _two_active(tmp_path)
    with torch.no_grad():
        ref = pm(**kwargs).last_hidden_state
    enc = Encoder.from_hf(model, dtype=torch.float32)
    enc.load_adapter("ab", [tmp_path / "a", tmp_path / "b"])
    out = enc(**kwargs, adapter_ids=["ab", None, "ab", "ab"]).last_hidden_state
    assert rel_err(out[[0, 2, 3]], ref[[0, 2, 3]], mask[[0, 2, 3]]) <= 1e-5
    row = {k: v[2:3, :LENGTHS[2]] for k, v in kwargs.items()}
    assert torch.equal(enc(**row, adapter_ids=["ab"]).last_hidden_state[0], out[2, :LENGTHS[2]])
    with pytest.raises(ValueError, match="empty list"):
        enc.load_adapter("none", [])
    _, task = _peft("bert-seq-cls", tmp_path / "task")
    with pytest.raises(LoadError, match="modules_to_save tensors"):
        enc.load_adapter("task", [tmp_path / "a", tmp_path / "task" / "a"])
    assert enc.adapters == ["ab"]


def test_errors(tmp_path):
    model, pm = _peft("bert", tmp_path)
    dora = peft.get_peft_model(MODELS["bert"](), peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
    with pytest.raises(LoadError, match="use_dora"):
        bertfast.optimize(dora)
    ia3 = peft.get_peft_model(MODELS["bert"](), peft.IA3Config(target_modules=["key", "value", "output.dense"],
                                                               feedforward_modules=["output.dense"]))
    for merge in (False, True):
        with pytest.raises(LoadError, match="peft_type is 'IA3'"):
            bertfast.optimize(ia3, merge=merge)
    _, merged = _peft("bert", tmp_path / "merged")
    merged.merge_adapter()
    with pytest.raises(ValueError, match="unmerge_adapter"):
        bertfast.optimize(merged)
    _, saved = _peft("bert", tmp_path / "saved", modules_to_save=["pooler"])
    with pytest.raises(LoadError, match="modules_to_save wraps a module of the encoder"):
        bertfast.optimize(saved)
    assert not _served(merged) and not _served(saved)
    with pytest.raises(ValueError, match="merge=True takes a peft.PeftModel"):
        bertfast.optimize(model, merge=True)


# --- a SentenceTransformer with the adapter on its Transformer's model ---------------------------------------------

TEXTS = sentences(24, seed=5, long_every=6, long_words=(60, 90))  # ragged, some past the model's 64 positions
HOWS = ["add_adapter", "load_adapter", "saved", "peft_model"]


@pytest.fixture
def integration(monkeypatch):
    """transformers' PEFT integration (what a SentenceTransformer's add_adapter, load_adapter, set_adapter call) checks
    PEFT's version against its MIN_PEFT_VERSION: transformers 5.25 asks for 0.22, newer than PEFT's newest release
    (0.21.2, installed here). Where PEFT is older the gate is lifted for the test: the calls used here run on 0.21,
    and every test compares with the model's own forward."""
    from transformers.integrations import peft as hf_peft

    if Version(peft.__version__) < Version(getattr(hf_peft, "MIN_PEFT_VERSION", "0")):
        monkeypatch.setattr(hf_peft, "check_peft_version", lambda min_version: None)


def _st(path):
    return st.SentenceTransformer(modules=[Transformer(path), Pooling(64), Normalize()], device="cpu").eval()


def _lora(**extra):
    return peft.LoraConfig(r=4, lora_alpha=6, target_modules=TARGETS, **extra)


def _st_with_adapter(how, path, tmp_path):
    """A SentenceTransformer over the random BERT at `path` with a random LoRA adapter, given it `how`."""
    model = _st(path)
    if how == "peft_model":  # sentence-transformers 6 holds it as `model` (`auto_model` reads it), 5 as `auto_model`
        slot = "model" if isinstance(getattr(type(model[0]), "auto_model", None), property) else "auto_model"
        setattr(model[0], slot, randomize(peft.get_peft_model(model[0].auto_model, _lora())))
    elif how == "load_adapter":
        save_lora(model[0].auto_model, tmp_path / "a", r=4, lora_alpha=6, target_modules=TARGETS)
        model.load_adapter(str(tmp_path / "a"))
    else:
        model.add_adapter(_lora())
        randomize(model[0].auto_model)
        if how == "saved":  # the adapter's files beside the stack's; loading finds the base by its path
            model.save(str(tmp_path / "st"))
            model = st.SentenceTransformer(str(tmp_path / "st"), device="cpu").eval()
    return model


def _engine(model):
    """The Encoder serving a SentenceTransformer's Transformer, or None."""
    hf = model[0].auto_model
    hf = hf.get_base_model() if isinstance(hf, peft.PeftModel) else hf
    return getattr(hf.base_model, "_bertfast_encoder", None)


def _encode(model, texts=TEXTS, **kwargs):
    return model.encode(texts, convert_to_tensor=True, **kwargs)


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
@pytest.mark.parametrize("how", HOWS)
def test_sentence_transformer_with_adapter_matches_its_encode(how, merge, integration, tiny_text_model, tmp_path):
    model = _st_with_adapter(how, tiny_text_model, tmp_path)
    ref, base = _encode(model), _encode(_st(tiny_text_model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the engine serves every call: no fallback
        served = bertfast.optimize(model, strict=True, merge=merge)
        ours = _encode(served)
    assert rel_err(ours, ref) <= 1e-5
    assert rel_err(ours, base) > 1e-2  # the adapter does change the embeddings
    assert _engine(served) is not None
    if not merge:
        assert served is model and _engine(model).default_adapter == "default"
        return
    assert served is not model and type(served[0].auto_model).__name__ == "BertModel"
    assert not any("lora_" in k for k in served.state_dict())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert _engine(model) is None and torch.equal(_encode(model), ref)


@pytest.mark.parametrize("how", ["add_adapter", "peft_model"])
def test_sentence_transformer_merged_after_served_unmerged(how, integration, tiny_text_model, tmp_path):
    model = _st_with_adapter(how, tiny_text_model, tmp_path)
    ref = _encode(model)
    bertfast.optimize(model, strict=True)
    merged = bertfast.optimize(model, strict=True, merge=True)  # copies the model, not the engine serving it
    assert rel_err(_encode(merged), ref) <= 1e-5 and rel_err(_encode(model), ref) <= 1e-5
    assert _engine(merged) is not _engine(model) and _engine(model).default_adapter == "default"


def test_sentence_transformer_adapter_row_alone_equals_row_in_batch(integration, tiny_text_model, tmp_path):
    model = bertfast.optimize(_st_with_adapter("add_adapter", tiny_text_model, tmp_path), strict=True)
    together = model.encode(TEXTS, output_value="token_embeddings", batch_size=len(TEXTS))
    pooled = _encode(model, batch_size=len(TEXTS))
    assert sum(len(t) for t in together) > 256  # past every row threshold of the native GEMMs, twice
    for i, text in enumerate(TEXTS):
        alone = model.encode([text], output_value="token_embeddings")[0]
        assert torch.equal(alone, together[i]), f"text {i} ({len(alone)} tokens) differs alone"
        assert torch.equal(_encode(model, [text])[0], pooled[i]), f"text {i}'s embedding differs alone"


def test_sentence_transformer_disabled_or_switched_adapter_runs_the_original_modules(integration, tiny_text_model):
    model = _st(tiny_text_model)
    for seed, name in enumerate(("a", "b")):
        model.add_adapter(_lora(), adapter_name=name)
        randomize(model[0].auto_model, seed, adapter=name)
    ref_b = _encode(model)  # add_adapter makes the new adapter the active one
    model.set_adapter("a")
    ref_a = _encode(model)
    model.disable_adapters()
    ref_off = _encode(model)
    assert min(rel_err(ref_a, ref_b), rel_err(ref_a, ref_off), rel_err(ref_b, ref_off)) > 1e-2
    bertfast.optimize(model)  # disabled: served, the calls fall back until the adapters are enabled
    assert _engine(model).default_adapter == "a"
    with pytest.warns(UserWarning, match="adapters are disabled"):
        assert torch.equal(_encode(model), ref_off)
    model.enable_adapters()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rel_err(_encode(model), ref_a) <= 1e-5
    model.set_adapter("b")
    with pytest.warns(UserWarning, match="no longer 'a'"):
        assert torch.equal(_encode(model), ref_b)


def test_sentence_transformer_adapter_sum_and_errors(integration, tiny_text_model):
    model = _st(tiny_text_model)
    with pytest.raises(ValueError, match="merge=True takes a SentenceTransformer whose Transformer's model has"):
        bertfast.optimize(model, merge=True)
    for name in ("a", "b"):
        model.add_adapter(_lora(), adapter_name=name)
    randomize(model[0].auto_model)
    model.set_adapter(["a", "b"])  # PEFT sums both deltas; the engine serves them stacked as one adapter
    ref = _encode(model)
    assert rel_err(_encode(bertfast.optimize(model, merge=True)), ref) <= 1e-5
    bertfast.optimize(model)
    assert _engine(model).default_adapter == "a+b" and rel_err(_encode(model), ref) <= 1e-5
    model = _st(tiny_text_model)
    model.add_adapter(_lora(), adapter_name="a")
    model.set_adapter("a")
    model.disable_adapters()
    with pytest.raises(ValueError, match="adapters are disabled .*merging 'a'"):
        bertfast.optimize(model, merge=True)
    assert _engine(model) is None
    dora = _st(tiny_text_model)
    dora.add_adapter(_lora(use_dora=True))
    with pytest.raises(bertfast.EngineUnsupported, match="use_dora"):
        bertfast.optimize(dora, strict=True)
    for merge in (False, True):  # as any SentenceTransformer the engine cannot serve: unchanged, after a warning
        with pytest.warns(UserWarning, match="cannot serve this SentenceTransformer.*use_dora"):
            assert bertfast.optimize(dora, merge=merge) is dora
    assert _engine(dora) is None
