"""LoRA adapters (bertfast.adapters): PEFT's saved adapters mapped onto the engine's fused slots, checked against
PEFT itself, and every refusal naming its tensor, shape or field.

- Merging a loaded Adapter into the base weights (W + B A per slot) equals PEFT's merge_and_unload() loaded the same
  way, on every family (fused QKV, gated FFNs in both row orders, ALBERT's shared layers, DeBERTa's position
  projections), with rsLoRA, rank / alpha patterns, fan_in_fan_out and layers_to_transform.
- The per-row reference delta of a packed ragged batch mixing two adapters and base rows equals each PEFT LoRA
  module's own forward minus its base layer's, row by row.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

from bertfast.adapters import apply_adapters_reference, group_rows, load_adapter, merge
from bertfast.adapters_peft import write_peft_dir
from bertfast.loading import PROJECTION, LoadError, load_hf_model
from helpers import families
from helpers.adapters import CASES, edited, hidden_rows, position_inputs, save_lora

SLOT_TENSORS = ("qkv_weight", "attn_out_weight", "ffn_in_weight", "ffn_out_weight", "pos_key", "pos_query")
FP32 = dict(rtol=1e-6, atol=1e-6)


def _assert_merged_like_peft(model, pm, path, **load_kw):
    """load_adapter + merge == PEFT's merge_and_unload() through load_hf_model, every slot, the pooler and the embedding
    projection; and every slot the adapter holds changed the base."""
    base = load_hf_model(model)
    adapter = load_adapter(path, base, "a", **load_kw)
    ours = merge(base, adapter, position_inputs(model))
    ref = load_hf_model(pm.merge_and_unload())
    assert len(ours.layers) == len(ref.layers)
    for i, (o, r, b) in enumerate(zip(ours.layers, ref.layers, base.layers)):
        for name in SLOT_TENSORS:
            if getattr(r, name) is None:
                continue
            torch.testing.assert_close(getattr(o, name), getattr(r, name), **FP32, msg=f"layer {i} {name}")
        for slot in adapter.layers[i]:
            name = slot if slot.startswith("pos_") else slot + "_weight"
            assert not torch.equal(getattr(o, name), getattr(b, name)), f"layer {i}: {slot} unchanged"
    if ref.pooler_weight is not None:
        torch.testing.assert_close(ours.pooler_weight, ref.pooler_weight, **FP32)
    if ref.embeddings.projection_weight is not None:
        torch.testing.assert_close(ours.embeddings.projection_weight, ref.embeddings.projection_weight, **FP32)
        changed = not torch.equal(ours.embeddings.projection_weight, base.embeddings.projection_weight)
        assert changed == (adapter.projection is not None)
    def sharing(layers):  # which executed layers are one object (ALBERT's groups)
        return [next(j for j, m in enumerate(layers) if m is layer) for layer in layers]
    assert sharing(ours.layers) == sharing(base.layers) == sharing(adapter.layers)
    return adapter


@pytest.mark.parametrize("family", sorted(CASES))
def test_merged_equals_peft(family, tmp_path):
    build, targets = CASES[family]
    model = build()
    pm = save_lora(model, tmp_path, r=4, lora_alpha=6, target_modules=targets)
    adapter = _assert_merged_like_peft(model, pm, tmp_path)
    distinct = {id(d): d for d in adapter.layers}.values()  # ALBERT's shared layers count once
    pairs = [p for d in distinct for p in d.values()] + [p for p in (adapter.pooler, adapter.projection) if p]
    assert adapter.nbytes == sum(4 * (A.numel() + B.numel()) for A, B in pairs)


@pytest.mark.parametrize("family", sorted(CASES))
def test_all_linear_targets(family, tmp_path):
    """target_modules="all-linear": PEFT writes every linear's whole name into the config, each matched by PEFT's rule
    (equal, or ending in "." + it); ELECTRA's and ALBERT's include the embedding projection."""
    build, _ = CASES[family]
    model = build()
    pm = save_lora(model, tmp_path, r=4, lora_alpha=6, target_modules="all-linear")
    adapter = _assert_merged_like_peft(model, pm, tmp_path)
    assert (adapter.projection is not None) == (family in PROJECTION)


@pytest.mark.parametrize("family, lora", [
    pytest.param("bert", dict(r=3, lora_alpha=5, use_rslora=True), id="bert-rslora"),
    pytest.param("modernbert", dict(r=5, lora_alpha=7, use_rslora=True), id="modernbert-rslora"),
    pytest.param("bert", dict(r=4, lora_alpha=3, rank_pattern={"value": 2, "layer.1.attention.self.query": 7},
                              alpha_pattern={"key": 11}), id="bert-rank-alpha-patterns"),
    pytest.param("distilbert", dict(r=4, lora_alpha=3, rank_pattern={"lin1": 6}, use_rslora=True),
                 id="distilbert-rank-pattern-rslora"),
    pytest.param("bert", dict(r=2, lora_alpha=2, layers_to_transform=[1]), id="bert-layers-to-transform"),
    pytest.param("nomic_bert", dict(r=2, lora_alpha=3, rank_pattern={"up_proj": 3}), id="nomic-gate-up-ranks"),
])
def test_merged_equals_peft_options(family, lora, tmp_path):
    build, targets = CASES[family]
    model = build()
    pm = save_lora(model, tmp_path, target_modules=targets, **lora)
    adapter = _assert_merged_like_peft(model, pm, tmp_path)
    if "layers_to_transform" in lora:
        assert adapter.layers[0] == {} and adapter.layers[1]


def test_task_model_heads_and_regex_targets(tmp_path):
    """A task model's adapter (encoder under "bert."): regex target_modules, the classifier in modules_to_save kept
    as heads, the merge as PEFT's."""
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**families.COMMON, num_labels=3))
    pm = save_lora(model, tmp_path, r=4, lora_alpha=8, target_modules=r".*\.(query|value|output\.dense)",
                   modules_to_save=["classifier"])
    adapter = _assert_merged_like_peft(model.bert, pm, tmp_path)
    assert adapter.prefix == "bert."
    assert sorted(adapter.heads) == ["classifier.bias", "classifier.weight"]
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    torch.testing.assert_close(adapter.heads["classifier.weight"], saved["base_model.model.classifier.weight"])


def test_fan_in_fan_out_reads_the_same(tmp_path):
    """fan_in_fan_out only says how PEFT merges into a transposed (Conv1D) base weight: on linears PEFT itself turns
    it off, and the factors keep their shapes; a config saying True loads the same slots."""
    model = families.build("bert")
    save_lora(model, tmp_path / "a", r=4, lora_alpha=4, target_modules=["query", "value"])
    flipped = edited(tmp_path / "a", tmp_path / "b", config={"fan_in_fan_out": True})
    base = load_hf_model(model)
    a, b = load_adapter(tmp_path / "a", base, "a"), load_adapter(flipped, base, "b")
    for sa, sb in zip(a.layers, b.layers):
        assert sa.keys() == sb.keys() and all(torch.equal(x, y) for s in sa for x, y in zip(sa[s], sb[s]))


def _hub_adapter(path, base, modules, r=2, alpha=3):
    """A hand-written adapter over a hub layout's module names: (directory, {module: (A, B)})."""
    g = torch.Generator().manual_seed(5)
    factors = {}
    for module, rows, cols in modules:
        factors[module] = (torch.randn(r, cols, generator=g), torch.randn(rows, r, generator=g))
    targets = sorted({m.rsplit(".", 1)[-1] for m, _, _ in modules})
    write_peft_dir(path, factors, rank=r, alpha=alpha, target_modules=targets)
    return factors, alpha / r


def test_written_dir_is_peft_format(tmp_path):
    """`write_peft_dir` writes what PEFT itself loads: its factors and scale in PEFT's modules (a linear's and an
    embedding table's)."""
    peft = pytest.importorskip("peft")
    model = families.build("bert")
    modules = dict(model.named_modules())
    g = torch.Generator().manual_seed(3)
    factors = {name: (torch.randn(4, modules[name].in_features, generator=g),
                      torch.randn(modules[name].out_features, 4, generator=g))
               for name in ("encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense")}
    word = modules["embeddings.word_embeddings"]
    table = {"embeddings.word_embeddings": (torch.randn(4, word.num_embeddings, generator=g),
                                            torch.randn(word.embedding_dim, 4, generator=g))}
    write_peft_dir(tmp_path / "a", {**factors, **table}, rank=4, alpha=6,
                   target_modules=["query", "dense", "word_embeddings"], tables=set(table))
    loaded = dict(peft.PeftModel.from_pretrained(model, str(tmp_path / "a")).named_modules())
    for name, (A, B) in factors.items():
        layer = loaded[f"base_model.model.{name}"]
        assert torch.equal(layer.lora_A["default"].weight, A) and torch.equal(layer.lora_B["default"].weight, B)
        assert layer.scaling["default"] == 6 / 4
    (name, (A, B)), = table.items()
    layer = loaded[f"base_model.model.{name}"]
    assert torch.equal(layer.lora_embedding_A["default"], A) and torch.equal(layer.lora_embedding_B["default"], B)
    untouched = loaded["base_model.model.encoder.layer.0.attention.self.key"]
    assert not hasattr(untouched, "lora_A")


@pytest.mark.parametrize("family", ["gte", "nomic_bert"])
def test_hub_layouts(family, tmp_path):
    """The hub layouts' fused modules: GTE's qkv_proj and up_gate_proj (up half first: the slot's rows are
    gate | up), NomicBERT's Wqkv and fc11 (up) / fc12 (gate), each slot's delta as the modules' own."""
    model = CASES[family][0]()
    base = load_hf_model(model)
    H, I, L = base.config.hidden_size, base.config.intermediate_size, len(base.layers)
    if family == "gte":
        names = [(f"encoder.layer.{i}.attention.qkv_proj", 3 * H, H) for i in range(L)]
        names += [(f"encoder.layer.{i}.mlp.up_gate_proj", 2 * I, H) for i in range(L)]
    else:
        names = [(f"encoder.layers.{i}.attn.Wqkv", 3 * H, H) for i in range(L)]
        names += [(f"encoder.layers.{i}.mlp.{n}", I, H) for i in range(L) for n in ("fc11", "fc12")]
    factors, scale = _hub_adapter(tmp_path / "a", base, names)
    merged = merge(base, load_adapter(tmp_path / "a", base, "a"))
    for i in range(L):
        def delta(m):
            A, B = factors[m]
            return scale * B @ A
        if family == "gte":
            qkv = delta(f"encoder.layer.{i}.attention.qkv_proj")
            ffn = torch.cat(delta(f"encoder.layer.{i}.mlp.up_gate_proj").chunk(2)[::-1])
        else:
            qkv = delta(f"encoder.layers.{i}.attn.Wqkv")
            ffn = torch.cat([delta(f"encoder.layers.{i}.mlp.fc12"), delta(f"encoder.layers.{i}.mlp.fc11")])
        torch.testing.assert_close(merged.layers[i].qkv_weight, base.layers[i].qkv_weight + qkv, **FP32)
        torch.testing.assert_close(merged.layers[i].ffn_in_weight, base.layers[i].ffn_in_weight + ffn, **FP32)


@pytest.mark.parametrize("family, module, slot, rows", [
    pytest.param("bert", "encoder.layer.{i}.attention.self.{p}", "qkv", ("query", "key", "value"), id="bert-qkv"),
    pytest.param("roberta", "encoder.layer.{i}.attention.self.{p}", "qkv", ("query", "key", "value"),
                 id="roberta-qkv-untargeted-key"),
    pytest.param("modernbert", "layers.{i}.{p}", "ffn_in", ("mlp.Wi",), id="modernbert-ffn-in"),
    pytest.param("nomic_bert", "layers.{i}.mlp.{p}", "ffn_in", ("gate_proj", "up_proj"), id="nomic-ffn-in"),
    pytest.param("distilbert", "transformer.layer.{i}.{p}", "ffn_out", ("ffn.lin2",), id="distilbert-ffn-out"),
])
def test_per_row_reference_equals_peft_modules(family, module, slot, rows, tmp_path):
    """A ragged packed batch mixing two adapters and base rows: each row's slot delta is its adapter's PEFT modules'
    forward minus their base layers' (zero for base rows), side by side in the slot's row order."""
    build, targets = CASES[family]
    model = build()
    pms = [save_lora(model, tmp_path / n, seed=s, r=r, lora_alpha=5, target_modules=targets)
           for n, s, r in (("a", 1, 4), ("b", 2, 3))]
    base = load_hf_model(model)
    adapters = [load_adapter(tmp_path / n, base, n) for n in "ab"]
    lengths, owner = [5, 1, 7, 3, 4, 2], [0, None, 1, 0, None, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    i = 1
    width = getattr(base.layers[i], slot + "_weight").shape[1]
    x = hidden_rows(int(cu[-1]), width)
    got = apply_adapters_reference(x, cu, [None if o is None else adapters[o] for o in owner], i, slot,
                                   getattr(base.layers[i], slot + "_weight").shape[0])
    expected = []
    for b, o in enumerate(owner):
        xs = x[cu[b]:cu[b + 1]]
        if o is None:
            expected.append(torch.zeros(len(xs), got.shape[1]))
            continue
        parts = []
        with torch.no_grad():
            for p in rows:
                lora = pms[o].base_model.model.get_submodule(module.format(i=i, p=p))
                adapted = hasattr(lora, "base_layer")  # PEFT's LoRA wrapper; an untargeted module stays a Linear
                parts.append(lora(xs) - lora.base_layer(xs) if adapted else torch.zeros(len(xs), lora.out_features))
        expected.append(torch.cat(parts, 1))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
    groups = group_rows(cu, [None if o is None else adapters[o] for o in owner])
    assert [g[0].name for g in groups] == ["a", "b"]
    assert groups[0][1].tolist() == [0, 1, 2, 3, 4, 13, 14, 15]


# --------------------------------------------------------------------------------------------
# Refusals


@pytest.fixture(scope="module")
def bert_adapter(tmp_path_factory):
    """(base weights, directory) of a BERT adapter with r=4 on query / value / intermediate.dense."""
    path = tmp_path_factory.mktemp("bert-adapter")
    model = families.build("bert")
    save_lora(model, path, r=4, lora_alpha=8, target_modules=["query", "value", "intermediate.dense"])
    return load_hf_model(model), path


A0 = "base_model.model.encoder.layer.0.attention.self.query.lora_A.weight"
B0 = "base_model.model.encoder.layer.0.attention.self.query.lora_B.weight"


@pytest.mark.parametrize("edit, match", [
    pytest.param(dict(config={"peft_type": "IA3"}), "peft_type is 'IA3'", id="peft-type"),
    pytest.param(dict(config={"use_dora": True}), r"use_dora = True .*DoRA", id="dora"),
    pytest.param(dict(config={"bias": "all"}), r"bias = 'all'", id="bias"),
    pytest.param(dict(config={"r": 8}), rf"{A0}.*rank 4.*r \(or rank_pattern\) is 8: mismatched rank",
                 id="mismatched-rank"),
    pytest.param(dict(config={"rank_pattern": {"value": 2}}), r"value\.lora_A\.weight' has rank 4.*is 2",
                 id="mismatched-rank-pattern"),
    pytest.param(dict(drop=[B0]), rf"{A0}' has no lora_B \({B0} is missing\)", id="missing-lora-B"),
    pytest.param(dict(tensors={A0: torch.zeros(4, 32)}), rf"{A0}' has shape \(4, 32\), the base model needs \(4, 64\)",
                 id="wrong-shape-A"),
    pytest.param(dict(tensors={B0: torch.zeros(48, 4)}), rf"{B0}' has shape \(48, 4\), the base model needs \(64, 4\)",
                 id="wrong-shape-B"),
    pytest.param(dict(config={"target_modules": ["query", "value", "intermediate.dense", "q_lin"]}),
                 r"target module 'q_lin' \(target_modules\) is not a module of a bert model", id="target-family-lacks"),
    pytest.param(dict(config={"target_modules": ["query", "value"]}),
                 r"intermediate\.dense' is not selected by target_modules", id="untargeted-tensor"),
    pytest.param(dict(config={"layers_to_transform": [1]}), rf"{A0}' lies outside layers_to_transform \[1\]",
                 id="layers-to-transform"),
    pytest.param(dict(tensors={"base_model.model.classifier.weight": torch.zeros(2, 64)}),
                 r"'base_model\.model\.classifier\.weight' is neither a LoRA factor nor part of modules_to_save",
                 id="stray-tensor"),
    pytest.param(dict(config={"auto_mapping": {"base_model_class": "DistilBertModel"}}),
                 r"auto_mapping\.base_model_class is 'DistilBertModel'.*another family.*\(bert\)", id="other-family"),
    pytest.param(dict(config={"target_modules": ".*query"},
                      tensors={"base_model.model.encoder.layer.0.attention.q_lin.lora_A.weight": torch.zeros(4, 64),
                               "base_model.model.encoder.layer.0.attention.q_lin.lora_B.weight": torch.zeros(64, 4)}),
                 r"encoder\.layer\.0\.attention\.q_lin' is not a linear of a bert model", id="module-family-lacks"),
    pytest.param(dict(config={"r": 0}), r"r = 0, expected a positive number", id="rank-zero"),
])
def test_bad_adapter_is_refused(bert_adapter, edit, match, tmp_path):
    base, path = bert_adapter
    with pytest.raises(LoadError, match=match):
        load_adapter(edited(path, tmp_path / "bad", **edit), base, "bad")


def test_wrong_base_is_refused(bert_adapter, tmp_path):
    """An adapter trained on another base: a hidden size of 32 against the adapter's 64, or another model's name."""
    _, path = bert_adapter
    torch.manual_seed(0)
    other = load_hf_model(transformers.BertModel(transformers.BertConfig(**{**families.COMMON, "hidden_size": 32})))
    with pytest.raises(LoadError, match=r"lora_A\.weight' has shape \(4, 64\), the base model needs \(4, 32\)"):
        load_adapter(path, other, "a")
    named = edited(path, tmp_path / "named", config={"base_model_name_or_path": "org/model-a"})
    with pytest.raises(LoadError, match=r"base_model_name_or_path is 'org/model-a', the base model is 'x/model-b'"):
        load_adapter(named, load_hf_model(families.build("bert")), "a", base_name="x/model-b")
    load_adapter(named, load_hf_model(families.build("bert")), "a", base_name="/models/model-a")


def test_pickle_and_missing_files_are_refused(bert_adapter, tmp_path):
    base, path = bert_adapter
    pickled = edited(path, tmp_path / "pickled")
    torch.save({}, os.path.join(pickled, "adapter_model.bin"))
    os.remove(os.path.join(pickled, "adapter_model.safetensors"))
    with pytest.raises(LoadError, match=r"adapter_model\.bin: pickle files are not loaded"):
        load_adapter(pickled, base, "a")
    os.remove(os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(LoadError, match=r"has no adapter_model\.safetensors"):
        load_adapter(pickled, base, "a")
    with pytest.raises(LoadError, match=r"does not exist"):
        load_adapter(tmp_path / "nowhere", base, "a")
    truncated = edited(path, tmp_path / "truncated")
    weights = os.path.join(truncated, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(LoadError, match=r"not a valid safetensors file"):
        load_adapter(truncated, base, "a")


def test_scale_is_folded_per_module(tmp_path):
    """rsLoRA divides alpha by sqrt(r): the slot's B is the saved B times alpha / sqrt(r), bit for bit."""
    model = families.build("bert")
    save_lora(model, tmp_path, r=3, lora_alpha=5, use_rslora=True, target_modules=["value"])
    adapter = load_adapter(tmp_path, load_hf_model(model), "a")
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    A, B = adapter.layers[1]["qkv"]
    H = model.config.hidden_size
    assert B.shape == (3 * H, 3) and not B[:2 * H].any()
    assert torch.equal(B[2 * H:], saved["base_model.model.encoder.layer.1.attention.self.value.lora_B.weight"]
                       * (5 / math.sqrt(3)))
