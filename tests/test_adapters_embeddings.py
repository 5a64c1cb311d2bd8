"""LoRA on the embedding tables (PEFT's `lora_embedding_A` / `lora_embedding_B` on the word, position and token-type
tables; bertfast/adapters_embeddings.py).

- fp32 within 1e-5 (relative) of PEFT's own unmerged PeftModel on a ragged batch mixing an adapter of several tables
  and a linear, one of the word table alone, one of a linear alone, and base rows, on every family's tables (ALBERT's
  and ELECTRA's narrower embeddings, ModernBERT's tok_embeddings), on the cpu and torch backends and the triton
  backend (under the interpreter); bf16 within twice PEFT's bf16 error.
- A row alone equals the same row in a 481-token mixed batch bit for bit (fp32, bf16, int8) on every tier; base rows
  equal the forward without adapters. A masked LM's decoder tied to the word table stays the base table, as in PEFT.
- `merge` and `stack` of table adapters (the engine serving the sum too); `bertfast.reference` (the oracle
  `validate --adapter` judges by) against PEFT; `optimize(peft_model)` unmerged and merged; the refusals: a table
  the base model lacks, a factor without its pair, another vocabulary, a linear's factor names on a table.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from bertfast import Encoder, reference
from bertfast.accuracy import within
from bertfast.adapters import load_adapter, merge, stack
from bertfast.backends import available_backends
from bertfast.backends.cpu import isa as isa_module
from bertfast.loading import LoadError, load_hf_model
from conftest import rel_err
from helpers import families
from helpers.adapters import CASES, LONG_LENGTHS, LONG_ROWS, TIER_IDS, TIERS, edited, peft_names, save_lora
from helpers.caps import on_cap

CPU_REASON = available_backends("cpu").get("cpu")
TRITON_REASON = available_backends("cpu").get("triton")
needs_cpu = pytest.mark.skipif(CPU_REASON is not None, reason=f"backend 'cpu' unavailable: {CPU_REASON}")

# family -> the tables and one linear adapter "a" targets ("b" targets the first entry alone, "c" the last).
TARGETS = {
    "bert": ["word_embeddings", "position_embeddings", "token_type_embeddings", "query"],
    "roberta": ["word_embeddings", "position_embeddings", "value"],  # positions counted from the pad id
    "albert": ["word_embeddings", "position_embeddings", "token_type_embeddings", "query"],  # E < H
    "electra": ["word_embeddings", "token_type_embeddings", "key"],
    "distilbert": ["word_embeddings", "q_lin"],
    "mpnet": ["word_embeddings", "q"],
    "deberta-v2": ["word_embeddings", "value_proj"],
    "modernbert": ["tok_embeddings", "Wqkv"],
    "nomic_bert": ["word_embeddings", "q_proj"],
    "gte": ["word_embeddings", "q_proj"],
}
LENGTHS = [7, 1, 12, 5, 9, 3, 11]
ROWS = ["a", None, "b", "c", "a", None, "b"]


def _adapters(model, root, family):
    """PeftModel with adapters "default" (every target, r 4), "b" (the first table, r 3) and "c" (the linear, rsLoRA
    r 5), and their directories."""
    targets = TARGETS[family]
    paths = {n: root / n for n in "abc"}
    pm = save_lora(model, paths["a"], seed=0, r=4, lora_alpha=6, target_modules=targets)
    for seed, (name, t, r) in enumerate((("b", targets[:1], 3), ("c", targets[-1:], 5)), start=1):
        save_lora(model, paths[name], seed=seed, r=r, lora_alpha=5, use_rslora=name == "c", target_modules=t)
        pm.load_adapter(paths[name], adapter_name=name)
    return pm.eval(), paths


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            model = CASES[family][0]()
            cache[family] = (model, *_adapters(model, tmp_path_factory.mktemp(family), family))
        return cache[family]
    return get


def _batch(model, family, lengths, seed=1):
    kwargs, mask = families.batch_for(model, lengths, seed=seed)
    if "position_embeddings" in TARGETS[family] and family != "roberta":  # PEFT's mixed batch needs them per row
        B, S = kwargs["input_ids"].shape
        kwargs["position_ids"] = torch.arange(S).expand(B, S).contiguous()
    return kwargs, mask


def _encoder(model, paths, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 measured slower on some tiers
        enc = Encoder.from_hf(model, **kw)
    for name, path in paths.items():
        enc.load_adapter(name, path)
    return enc


def _cases():
    """Every family on the cpu and torch backends; the triton one (slow under the interpreter) on an absolute-position
    and a rotary family."""
    triton = pytest.mark.skipif(TRITON_REASON is not None, reason=f"backend 'triton' unavailable: {TRITON_REASON}")
    cases = [pytest.param(f, "cpu", marks=needs_cpu, id=f"{f}-cpu") for f in TARGETS]
    cases += [pytest.param(f, "torch", id=f"{f}-torch") for f in TARGETS]
    return cases + [pytest.param(f, "triton", marks=triton, id=f"{f}-triton") for f in ("bert", "modernbert")]


@pytest.mark.parametrize("family, backend", _cases())
def test_fp32_matches_peft_mixed_batch(family, backend, built):
    model, pm, paths = built(family)
    kwargs, mask = _batch(model, family, LENGTHS)
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=peft_names(ROWS)).last_hidden_state
        base = model(**kwargs).last_hidden_state
    out = _encoder(model, paths, backend=backend, dtype=torch.float32)(**kwargs, adapter_ids=ROWS).last_hidden_state
    assert rel_err(out, ref, mask) <= 1e-5
    for b, name in enumerate(ROWS):  # the table adapters change their rows; base rows stay the base model's
        n = int(mask[b].sum())
        assert (rel_err(out[b:b + 1, :n], base[b:b + 1, :n]) > 1e-4) == (name is not None)


@needs_cpu
def test_bf16_within_twice_peft_bf16(built):
    model, pm, paths = built("bert")
    kwargs, mask = _batch(model, "bert", LENGTHS)
    names = peft_names(ROWS)
    with torch.no_grad():
        ref = pm(**kwargs, adapter_names=names).last_hidden_state
        low = copy.deepcopy(pm).to(torch.bfloat16)(**kwargs, adapter_names=names).last_hidden_state
    out = _encoder(model, paths, backend="cpu", dtype=torch.bfloat16)(**kwargs, adapter_ids=ROWS).last_hidden_state
    ours, theirs = rel_err(out, ref, mask), rel_err(low, ref, mask)
    assert within(ours, theirs, torch.bfloat16, floor=0.0, cap=False), f"bf16 {ours:.3g} vs PEFT bf16 {theirs:.3g}"



@needs_cpu
@pytest.mark.parametrize("tier", TIERS, ids=TIER_IDS)
@pytest.mark.parametrize("family, dtype", [("bert", torch.float32), ("bert", torch.bfloat16), ("bert", "int8"),
                                           ("modernbert", torch.float32)],
                         ids=["bert-fp32", "bert-bf16", "bert-int8", "modernbert-fp32"])
def test_row_alone_equals_row_in_mixed_batch(family, dtype, tier, built):
    if tier is not None and isa_module.unsupported(tier) is not None:
        pytest.skip(isa_module.unsupported(tier))
    model, _, paths = built(family)
    kwargs, mask = _batch(model, family, LONG_LENGTHS, seed=3)
    assert int(mask.sum()) > 256
    with on_cap(tier) if tier else contextlib.nullcontext():
        enc = _encoder(model, paths, backend="cpu", dtype=dtype)
        together = enc(**kwargs, adapter_ids=LONG_ROWS).last_hidden_state
        plain = enc(**kwargs).last_hidden_state
        for b, n in enumerate(mask.sum(1).tolist()):
            row = {k: v[b:b + 1, :n] for k, v in kwargs.items() if k != "attention_mask"}
            alone = enc(**row, adapter_ids=[LONG_ROWS[b]]).last_hidden_state[0]
            assert torch.equal(alone, together[b, :n]), f"row {b} ({n} tokens, {LONG_ROWS[b]}) differs alone"
            assert torch.equal(together[b, :n], plain[b, :n]) == (LONG_ROWS[b] is None), f"row {b}"


def test_reference_merge_and_stack(built):
    """The oracle runs the table terms unmerged as PEFT does; merged into the tables they give the same model; two
    adapters stacked give the sum of their terms (PEFT's several active adapters), in the oracle and the engine."""
    model, pm, paths = built("bert")
    weights = load_hf_model(model)
    kwargs, mask = _batch(model, "bert", LENGTHS)
    a, b = (load_adapter(paths[n], weights, n) for n in "ab")
    assert set(a.embeddings) == {"word", "position", "token_type"} and set(b.embeddings) == {"word"}
    with torch.no_grad():
        pm.set_adapter("default")
        ref = pm(**kwargs).last_hidden_state
        pm.base_model.set_adapter(["default", "b"])
        both = pm(**kwargs).last_hidden_state
        pm.set_adapter("default")
    assert rel_err(reference.forward(weights, **kwargs, adapter=a)[0], ref, mask) <= 1e-5
    assert rel_err(reference.forward(merge(weights, a), **kwargs)[0], ref, mask) <= 1e-5
    assert rel_err(reference.forward(weights, **kwargs, adapter=stack([a, b], "a+b"))[0], both, mask) <= 1e-5
    enc = _encoder(model, {}, backend="torch", dtype=torch.float32)
    enc.load_adapter("a+b", [paths["a"], paths["b"]])
    assert rel_err(enc(**kwargs, adapter_ids=["a+b"] * mask.shape[0]).last_hidden_state, both, mask) <= 1e-5
    pairs = [*a.embeddings.values(), *(pair for slots in a.layers for pair in slots.values())]
    assert a.nbytes == sum(t.numel() * t.element_size() for pair in pairs for t in pair)


def test_refusals(tmp_path, built):
    model, _, paths = built("bert")
    weights = load_hf_model(model)
    word = "base_model.model.embeddings.word_embeddings.lora_embedding_"
    with pytest.raises(LoadError, match=r"word_embeddings\.lora_embedding_A' has no lora_B .*lora_embedding_B is "
                                        r"missing"):
        load_adapter(edited(paths["b"], tmp_path / "no-b", drop=[word + "B"]), weights, "x")
    V = model.config.vocab_size
    with pytest.raises(LoadError, match=r"lora_embedding_A' has shape \(3, %d\), the base model needs \(3, %d\)"
                                        % (V + 1, V)):
        load_adapter(edited(paths["b"], tmp_path / "vocab", tensors={word + "A": torch.zeros(3, V + 1)}), weights, "x")
    linear = "base_model.model.embeddings.word_embeddings.lora_"
    renamed = edited(paths["b"], tmp_path / "linear-names", drop=[word + "A", word + "B"],
                     tensors={linear + "A.weight": torch.zeros(3, V),
                              linear + "B.weight": torch.zeros(model.config.hidden_size, 3)})
    with pytest.raises(LoadError, match=r"lora_embedding_A / lora_embedding_B and a linear's lora_A / lora_B"):
        load_adapter(renamed, weights, "x")
    distil, _, distil_paths = built("distilbert")  # no token-type table
    moved = "base_model.model.embeddings.token_type_embeddings.lora_embedding_"
    saved = edited(distil_paths["b"], tmp_path / "types", config={"target_modules": ["token_type_embeddings"]},
                   drop=[word + "A", word + "B"], tensors={moved + "A": torch.zeros(3, 2),
                                                            moved + "B": torch.zeros(distil.config.dim, 3)})
    with pytest.raises(LoadError, match=r"adapts the token_type embeddings, which the base model lacks"):
        load_adapter(saved, load_hf_model(distil), "x")


@pytest.mark.parametrize("merge", [False, True], ids=["unmerged", "merged"])
def test_optimize_peft_model_with_table_lora(merge, tmp_path):
    """`optimize(peft_model)` serves a table adapter: the base tables under PEFT's Embedding wrappers, the factors read
    in memory; merged, PEFT merges them into the tables."""
    import bertfast

    model = CASES["bert"][0]()
    pm = save_lora(model, tmp_path, r=4, lora_alpha=6, target_modules=TARGETS["bert"])
    kwargs, mask = _batch(model, "bert", LENGTHS)
    with torch.no_grad():
        ref = pm(**kwargs).last_hidden_state
        served = bertfast.optimize(pm, merge=merge)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the engine serves the call: no fallback
            ours = served(**kwargs).last_hidden_state
    assert rel_err(ours, ref, mask) <= 1e-5
    assert rel_err(ours, model(**kwargs).last_hidden_state, mask) > 1e-2


@needs_cpu
def test_word_table_adapter_leaves_the_tied_decoder(tmp_path):
    """A masked LM whose decoder is tied to the word table: PEFT's unmerged forward adds the table's term to the
    looked-up rows only, the decoder stays the base table; the task model's logits match it, rows alone and mixed."""
    import bertfast
    from helpers.heads import build as build_task

    model = build_task("bert", "MaskedLM")
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    model.save_pretrained(tmp_path / "model")
    pm = save_lora(model, tmp_path / "a", seed=2, r=4, lora_alpha=6, target_modules=["word_embeddings", "query"])
    kwargs, mask = families.batch_for(model, LENGTHS)
    rows = ["a", None] * (len(LENGTHS) // 2) + ["a"]
    with torch.no_grad():
        ref = torch.stack([(pm if a else model)(**kwargs).logits[i] for i, a in enumerate(rows)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = bertfast.load(tmp_path / "model", backend="cpu", dtype=torch.float32, adapters={"a": tmp_path / "a"})
    out = ours(**kwargs, adapter_ids=rows).logits
    assert rel_err(out, ref, mask) <= 1e-5
    alone = ours(**{k: v[:1, :LENGTHS[0]] for k, v in kwargs.items()}, adapter_ids=["a"]).logits[0]
    assert torch.equal(alone, out[0, :LENGTHS[0]])
