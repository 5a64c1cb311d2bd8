"""`bertfast.optimize(peft_model)`: a LoRA PeftModel served with its active adapter, unmerged or merged.

- fp32 within 1e-5 (relative, padded positions excluded) of the PeftModel's own forward, on a random BERT base model
  and a sequence classifier (PEFT's SEQ_CLS: the classifier in modules_to_save, run by PEFT in torch), unmerged
  (the PeftModel returned, its base served with the adapter as `Encoder.default_adapter`) and with merge=True (a
  merged copy returned, the PeftModel's state dict and classes unchanged).
- `Encoder.default_adapter`: every row gets it when the call names none, bit for bit as when named per row; an
  explicit adapter_ids with None rows gives base rows; it is validated and cannot be unloaded while set.
- A call the engine cannot serve with the adapter (`disable_adapter()`) runs the original modules after a warning.
- The errors: several active adapters, DoRA, another peft_type, unmerged: an adapter merged already or a
  modules_to_save inside the encoder; merge=True without a PeftModel.
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
import transformers

import bertfast
from bertfast import Encoder
from bertfast.adapters import UnknownAdapter
from bertfast.loading import LoadError
from conftest import rel_err
from helpers import families
from helpers.adapters import CASES, save_lora

LENGTHS = [7, 1, 12, 5]
TARGETS = CASES["bert"][1]


def _classifier():
    return transformers.BertForSequenceClassification(transformers.BertConfig(**families.COMMON, num_labels=3)).eval()


MODELS = {"bert": lambda: CASES["bert"][0]().eval(), "bert-seq-cls": _classifier}
TASK = {"bert": None, "bert-seq-cls": "SEQ_CLS"}


def _peft(name, tmp_path, **lora):
    model = MODELS[name]()
    return model, save_lora(model, tmp_path / "a", r=4, lora_alpha=6, target_modules=TARGETS, task_type=TASK[name],
                            **lora)


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


def test_errors(tmp_path):
    model, pm = _peft("bert", tmp_path)
    pm.load_adapter(tmp_path / "a", adapter_name="b")
    pm.base_model.set_adapter(["default", "b"])
    with pytest.raises(ValueError, match="2 active adapters"):
        bertfast.optimize(pm)
    assert not _served(pm)
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
