"""LoRA adapters in the engine's weight layout and the exact math of applying them per row (a forward's per-row
terms: `adapters_rows`).

`load_adapter` maps a PEFT LoRA directory (`adapters_peft`) onto the fused slots of `LayerWeights`: `qkv` (rows
q | k | v), `attn_out`, `ffn_in` (gated: rows gate | up), `ffn_out`, DeBERTa-v2's position projections `pos_key` /
`pos_query`, the model's `pooler`, and the embedding tables (`adapters_embeddings`). Each slot holds one pair
(A [r, K], B [N, r]) in fp32 with every module's scale folded into its rows of B, so the slot's delta is x A^T B^T
for any input x [T, K]. A slot fed by several
modules (q, k, v; gate, up) concatenates their A's and lays their B's out as blocks, zeros where a module is not
adapted: the slot's delta is exactly the separate deltas side by side. Everything is checked against the base
weights first; a bad adapter raises `LoadError` naming the tensor, shape or field, and no partial Adapter escapes.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .adapters_embeddings import embedding_modules
from .adapters_peft import (SAVED_PREFIX, PeftFiles, in_modules_to_save, is_targeted, layer_index, rank_and_scale,
                            read_peft_dir)
from .backends.weights import LayerWeights, ModelWeights
from .config import ModelConfig
from .loading import (BASE_PREFIX, EXTRA_PREFIXES, LAYER_NAMES, POOLER, PROJECTION, ROTARY_LAYOUTS, LoadError,
                      _layer_prefixes)

SLOTS = ("qkv", "attn_out", "ffn_in", "ffn_out", "pos_key", "pos_query")
# Which slot each module part of loading's tables feeds, in the slot's row order.
_PART_SLOT = {"query": "qkv", "key": "qkv", "value": "qkv", "qkv": "qkv", "attn_out": "attn_out",
              "ffn_in": "ffn_in", "gate": "ffn_in", "up": "ffn_in", "ffn_out": "ffn_out",
              "pos_key": "pos_key", "pos_query": "pos_query"}
# DeBERTa-v2's own position projections (share_att_key = False), relative to the layer.
_DEBERTA_POSITIONS = {"pos_key": "attention.self.pos_key_proj", "pos_query": "attention.self.pos_query_proj"}
# transformers class-name prefixes per family, to tell an adapter trained on another family (auto_mapping).
_CLASS_PREFIXES = {"bert": ("Bert",), "roberta": ("Roberta", "XLMRoberta"), "xlm-roberta": ("XLMRoberta", "Roberta"),
                   "electra": ("Electra",), "albert": ("Albert",), "distilbert": ("DistilBert",), "mpnet": ("MPNet",),
                   "modernbert": ("ModernBert",), "nomic_bert": ("NomicBert",), "gte": ("Gte", "NewModel", "New"),
                   "deberta-v2": ("DebertaV2",)}

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Adapter:
    """One loaded adapter. layers[i]: slot -> (A fp32 [r, K], B fp32 [N, r], scale folded into B) of executed layer
    i (one dict shared by the layers sharing weights, as ALBERT's); pooler: the pooler's pair or None; projection:
    the factorised embeddings' projection's (ELECTRA, ALBERT: embedding -> hidden) or None; heads: the
    modules_to_save tensors (task heads) by their name in the task model, fp32; head_lora: the pairs of linears of a
    task head (outside the encoder), by module name in the task model; embeddings: table ("word", "position",
    "token_type") -> (A [r, V], B [E, r]), an id's term A^T[id] B^T; config: adapter_config.json."""
    name: str
    layers: list[dict[str, Pair]]
    pooler: Pair | None = None
    projection: Pair | None = None
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    head_lora: dict[str, Pair] = field(default_factory=dict)
    embeddings: dict[str, Pair] = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    prefix: str = ""  # the encoder's prefix in the adapted model ("bert." for a task model, "" for a base one)

    @property
    def nbytes(self) -> int:
        tensors = {id(t): t for slots in self.layers for pair in slots.values() for t in pair}
        heads = [*self.heads.values(), *(t for d in (self.head_lora, self.embeddings) for p in d.values() for t in p)]
        tensors.update({id(t): t for t in [*(self.pooler or ()), *(self.projection or ()), *heads]})
        return sum(t.numel() * t.element_size() for t in tensors.values())


def _module_table(config: ModelConfig) -> list[tuple[list[str], dict[str, tuple[str, str]], dict]]:
    """Per checkpoint layout of the family: (executed layers' prefixes in order, module name -> (layer prefix,
    part), the layout's part -> module names), module names relative to the encoder, from loading's own tables."""
    if config.rotary:
        layouts = [([f"{lay['layers']}{i}." for i in range(config.num_hidden_layers)], lay["layer"])
                   for lay in ROTARY_LAYOUTS[config.family]]
    else:
        names = dict(LAYER_NAMES[config.family])
        if config.disentangled and not config.share_att_key:
            for part, term in (("pos_key", "c2p"), ("pos_query", "p2c")):
                if term in config.pos_att_type:
                    names[part] = _DEBERTA_POSITIONS[part]
        layouts = [(_layer_prefixes(config), names)]
    return [(prefixes, {p + m: (p, part) for p in prefixes for part, m in names.items() if part in _PART_SLOT}, names)
            for prefixes, names in layouts]


def _slot_shapes(config: ModelConfig, layer: LayerWeights) -> dict[str, tuple[str, int, int, int]]:
    """part -> (slot, first row in the slot, rows, in features) against the base layer's own tensors."""
    H = layer.qkv_weight.shape[0] // 3
    K = layer.qkv_weight.shape[1]
    F = layer.ffn_in_weight.shape[0] // (2 if config.gated_ffn else 1)
    shapes = {"query": ("qkv", 0, H, K), "key": ("qkv", H, H, K), "value": ("qkv", 2 * H, H, K),
              "qkv": ("qkv", 0, 3 * H, K), "attn_out": ("attn_out", 0, *layer.attn_out_weight.shape),
              "ffn_in": ("ffn_in", 0, *layer.ffn_in_weight.shape), "gate": ("ffn_in", 0, F, K),
              "up": ("ffn_in", F, F, K), "ffn_out": ("ffn_out", 0, *layer.ffn_out_weight.shape)}
    for slot in ("pos_key", "pos_query"):
        if getattr(layer, slot) is not None:
            shapes[slot] = (slot, 0, getattr(layer, slot).shape[1], K)
    return shapes


def _check_family(config: ModelConfig, adapter_config: dict, where: str) -> None:
    cls = (adapter_config.get("auto_mapping") or {}).get("base_model_class") or ""
    own = _CLASS_PREFIXES[config.family]
    others = [p for fam, ps in _CLASS_PREFIXES.items() if fam != config.family for p in ps if p not in own]
    if cls and not cls.startswith(own) and any(cls.startswith(p) for p in others):
        raise LoadError(f"{where}: auto_mapping.base_model_class is {cls!r}: the adapter was trained on another "
                        f"family than the base model's ({config.family})")


def _check_targets(config: ModelConfig, adapter_config: dict, names: dict, modules, where: str) -> None:
    """Each target_modules list entry must name a linear bertfast adapts in the family, by PEFT's rule (a module name
    equal to it or ending in "." + it): a layer-relative suffix, or a whole name of `modules` (the adapted model's
    layer linears and pooler, as PEFT writes `all-linear` out)."""
    targets = adapter_config["target_modules"]
    if isinstance(targets, str):
        return
    known = ({m for part, m in names.items() if part in _PART_SLOT} | set(embedding_modules(config))
             | {POOLER.get(config.family), PROJECTION.get(config.family)} - {None})
    for t in targets:  # modules_to_save (and what lies inside them) PEFT never adapts: whole copies instead
        if not in_modules_to_save(adapter_config, t + ".weight") and not any(
                m == t or m.endswith("." + t) for m in known | set(modules)):
            raise LoadError(f"{where}: target module {t!r} (target_modules) is not a module of a {config.family} "
                            f"model that bertfast adapts ({', '.join(sorted(known))})")


def load_adapter(path: str | os.PathLike | PeftFiles, base: ModelWeights, name: str, *,
                 base_name: str | None = None) -> Adapter:
    """A PEFT LoRA adapter directory (or one already read: `adapters_peft.read_peft_model` reads a PeftModel's) mapped
    onto `base`'s slots. base_name: the base model's name or path, compared with the adapter's
    base_model_name_or_path (by its last component) when both are given. Raises LoadError."""
    files = path if isinstance(path, PeftFiles) else read_peft_dir(path)
    cfg, config, where = files.config, base.config, os.path.join(files.path, "adapter_config.json")
    _check_family(config, cfg, where)
    trained_on = cfg.get("base_model_name_or_path")
    if base_name and trained_on and _last(trained_on) != _last(base_name):
        raise LoadError(f"{where}: base_model_name_or_path is {trained_on!r}, the base model is {base_name!r}")
    factors, heads, tabled = _split_tensors(cfg, files.tensors)
    prefixes, table, names, prefix = _match_layout(config, set(factors), files.path)
    _check_heads_outside(heads, prefix)
    head_factors = {m: factors.pop(m) for m in sorted(factors) if not m.startswith(prefix)}  # a task head's linears
    tables = embedding_modules(config)
    own = [prefix + d[config.family] for d in (POOLER, PROJECTION) if config.family in d] + [prefix + m for m in tables]
    _check_targets(config, cfg, names, [prefix + m for m in table] + own + list(head_factors), where)
    parts: dict[str, dict[str, list]] = {p: {} for p in prefixes}  # layer prefix -> slot -> [(row, A, B)]
    pooler, projection, head_lora, embeddings = None, None, {}, {}
    layer_of = {p: base.layers[prefixes.index(p)] for p in prefixes}
    for full, pair in sorted({**factors, **head_factors}.items()):
        module = full[len(prefix):]
        (a_name, A), (b_name, B) = pair["A"], pair["B"]
        if not is_targeted(cfg, full):
            raise LoadError(f"tensor {a_name!r}: module {full!r} is not selected by target_modules "
                            f"{cfg['target_modules']!r}")
        wanted = cfg.get("layers_to_transform")
        if wanted is not None and layer_index(cfg, full) not in ([wanted] if isinstance(wanted, int) else wanted):
            raise LoadError(f"tensor {a_name!r} lies outside layers_to_transform {wanted!r}")
        r, scale = rank_and_scale(cfg, full)
        if (module in tables) != (full in tabled):
            raise LoadError(f"tensor {a_name!r}: PEFT names an embedding table's factors lora_embedding_A / "
                            f"lora_embedding_B and a linear's lora_A / lora_B; {full!r} has the other kind")
        if module in tables:
            rows = getattr(base.embeddings, tables[module])
            if rows is None:
                raise LoadError(f"tensor {a_name!r} adapts the {tables[module]} embeddings, which the base model "
                                "lacks")
            _check_shapes(a_name, A, b_name, B, r, rows.shape[1], rows.shape[0])
            embeddings[tables[module]] = (A.float().contiguous(), (B.float() * scale).contiguous())
            continue
        if full in head_factors:  # merged into the adapter's copy of the head (`adapters_heads.adapted_head`)
            _check_shapes(a_name, A, b_name, B, r, B.shape[0], A.shape[1] if A.dim() == 2 else 0)
            head_lora[full] = (A.contiguous(), (B * scale).contiguous())
            continue
        if module == PROJECTION.get(config.family):
            if base.embeddings.projection_weight is None:
                raise LoadError(f"tensor {a_name!r} adapts the embedding projection, which the base model lacks")
            _check_shapes(a_name, A, b_name, B, r, *base.embeddings.projection_weight.shape)
            projection = (A.contiguous(), (B * scale).contiguous())
            continue
        if module == POOLER.get(config.family):
            if base.pooler_weight is None:  # an engine without the pooler (add_pooling_layer=False) never runs it
                continue
            _check_shapes(a_name, A, b_name, B, r, *base.pooler_weight.shape)
            pooler = (A.contiguous(), (B * scale).contiguous())
            continue
        layer_prefix, part = table[module]
        slot, row, rows, cols = _slot_shapes(config, layer_of[layer_prefix])[part]
        _check_shapes(a_name, A, b_name, B, r, rows, cols)
        if part == "ffn_in" and names.get("ffn_order") == "up_gate":
            B = torch.cat(B.chunk(2, 0)[::-1], 0)  # the slot's rows are gate | up
        parts[layer_prefix].setdefault(slot, []).append((row, A, B * scale))
        if config.disentangled and config.share_att_key and part in ("key", "query"):
            term, pos = ("c2p", "pos_key") if part == "key" else ("p2c", "pos_query")
            if term in config.pos_att_type:  # the position projections are this module's (`disentangled`)
                parts[layer_prefix].setdefault(pos, []).append((0, A, B * scale))
    built = {p: {slot: _fuse(items, _slot_rows(layer_of[p], slot)) for slot, items in slots.items()}
             for p, slots in parts.items()}
    return Adapter(name=name, layers=[built[p] for p in prefixes], pooler=pooler, projection=projection, heads=heads,
                   head_lora=head_lora, embeddings=embeddings, config=cfg, prefix=prefix)


def _split_tensors(cfg: dict, tensors: dict[str, torch.Tensor]):
    """(module -> {"A"/"B": (tensor name, tensor)}, head tensors by name, the modules whose factors are an embedding
    table's) of a saved adapter: every LoRA factor paired, every other tensor inside modules_to_save."""
    factors: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    heads, tabled = {}, set()
    for tname, t in tensors.items():
        if not tname.startswith(SAVED_PREFIX):
            raise LoadError(f"tensor {tname!r} does not start with {SAVED_PREFIX!r}: not a PEFT adapter file")
        short = tname[len(SAVED_PREFIX):]
        kind = next((k for k in "AB" if short.endswith(f".lora_{k}.weight")), None)
        table_kind = next((k for k in "AB" if short.endswith(f".lora_embedding_{k}")), None)
        if kind is not None:
            factors.setdefault(short[: -len(".lora_A.weight")], {})[kind] = (tname, t)
        elif table_kind is not None:
            module = short[: -len(".lora_embedding_A")]
            factors.setdefault(module, {})[table_kind] = (tname, t)
            tabled.add(module)
        elif ".lora_" in short:
            raise LoadError(f"tensor {tname!r}: only the lora_A / lora_B of linears and the lora_embedding_A / "
                            f"lora_embedding_B of embedding tables are supported (no DoRA magnitudes or LoRA biases)")
        elif not in_modules_to_save(cfg, short):
            raise LoadError(f"tensor {tname!r} is neither a LoRA factor nor part of modules_to_save")
        else:
            heads[short] = t
    for module, pair in factors.items():
        for kind, other in (("A", "B"), ("B", "A")):
            if other not in pair:
                missing = f"lora_embedding_{other}" if module in tabled else f"lora_{other}.weight"
                raise LoadError(f"tensor {pair[kind][0]!r} has no lora_{other} ({SAVED_PREFIX}{module}.{missing} is "
                                "missing)")
    return factors, heads, tabled


def _check_heads_outside(heads: dict[str, torch.Tensor], prefix: str) -> None:
    """modules_to_save may hold task-head modules only: a copy of a module inside the encoder (prefix "" is a base
    model, all encoder) would change the encoder's outputs, and the engine runs the base module there."""
    for name in sorted(heads):
        if not prefix or name.startswith(prefix):
            raise LoadError(f"tensor {SAVED_PREFIX + name!r}: modules_to_save wraps a module of the encoder, whose "
                            "trained copy the engine does not run (only task-head modules may be saved whole)")


def _last(name: str) -> str:
    return os.path.basename(os.path.normpath(name)).lower()


def _match_layout(config: ModelConfig, modules: set[str], path: str):
    """(layer prefixes, module table, layout names, encoder prefix) of the family's layout and prefix holding every
    adapted module (names as saved, relative to the adapted model)."""
    encoder_prefixes = ("", BASE_PREFIX[config.family]) + EXTRA_PREFIXES.get(config.family, ())
    own = ({d[config.family] for d in (POOLER, PROJECTION) if config.family in d}  # pooler, embedding projection
           | set(embedding_modules(config)))
    best = None
    for prefixes, table, names in _module_table(config):
        for prefix in encoder_prefixes:
            known = table.keys() | own
            missing = sorted(m for m in modules if not m.startswith(prefix) or m[len(prefix):] not in known)
            # A task model's adapter (prefix "bert." ...) may adapt its head's linears too, outside the prefix.
            head_only = prefix and len(missing) < len(modules) and all(not m.startswith(prefix) for m in missing)
            if not missing or head_only:
                return prefixes, table, names, prefix
            if best is None or len(missing) < len(best):
                best = missing
    raise LoadError(f"tensor {SAVED_PREFIX}{best[0]}.lora_A.weight in {path}: {best[0]!r} is not a linear of a "
                    f"{config.family} model's layers that bertfast adapts (a target module the family lacks, or "
                    f"another base model)")


def _check_shapes(a_name, A, b_name, B, r, rows, cols):
    if A.dim() != 2 or B.dim() != 2:
        raise LoadError(f"tensor {a_name!r} / {b_name!r}: LoRA factors must be matrices, found shapes "
                        f"{tuple(A.shape)} / {tuple(B.shape)}")
    if A.shape[0] != r or B.shape[1] != r:
        raise LoadError(f"tensor {a_name!r} has rank {A.shape[0]} and {b_name!r} rank {B.shape[1]}; the config's r "
                        f"(or rank_pattern) is {r}: mismatched rank")
    if A.shape[1] != cols:
        raise LoadError(f"tensor {a_name!r} has shape {tuple(A.shape)}, the base model needs {(r, cols)}: "
                        f"the adapter was trained on another base model")
    if B.shape[0] != rows:
        raise LoadError(f"tensor {b_name!r} has shape {tuple(B.shape)}, the base model needs {(rows, r)}: "
                        f"the adapter was trained on another base model")


def _slot_rows(layer: LayerWeights, slot: str) -> int:
    return (getattr(layer, slot).shape[1] if slot.startswith("pos_") else getattr(layer, slot + "_weight").shape[0])


def _fuse(items: list[tuple[int, torch.Tensor, torch.Tensor]], rows: int) -> Pair:
    """One (A, B) for a slot of `rows` outputs from its modules' (first row, A [r_i, K], B [n_i, r_i]): A stacked
    [sum r_i, K], B block-diagonal by rank [rows, sum r_i], zeros where a module is not adapted."""
    A = torch.cat([a for _, a, _ in items], 0).contiguous()
    B = torch.zeros(rows, A.shape[0], dtype=torch.float32)
    col = 0
    for row, a, b in items:
        B[row: row + b.shape[0], col: col + a.shape[0]] = b
        col += a.shape[0]
    return A, B


# --------------------------------------------------------------------------------------------
# The math: merged weights, and the per-row delta of a slot


def merge(base: ModelWeights, adapter: Adapter, position_inputs: torch.Tensor | None = None) -> ModelWeights:
    """`base` with `adapter` merged in (W + B A per slot, in fp32, back in each tensor's dtype); shared layers stay
    shared. position_inputs: (2 span, H), the relative embeddings as DeBERTa's position projections see them
    (LayerNorm'd when norm_rel_ebd), needed only when the adapter has pos_key / pos_query slots."""
    merged: dict[int, LayerWeights] = {}
    layers = []
    for layer, slots in zip(base.layers, adapter.layers):
        if id(layer) not in merged:
            new = {}
            for slot, (A, B) in slots.items():
                if slot.startswith("pos_"):
                    if position_inputs is None:
                        raise ValueError(f"adapter {adapter.name!r} adapts {slot}: merge needs position_inputs")
                    t = getattr(layer, slot)
                    delta = position_inputs.double() @ A.double().T @ B.double().T
                    new[slot] = (t.double() + delta).to(t.dtype)
                else:
                    w = getattr(layer, slot + "_weight")
                    new[slot + "_weight"] = (w.float() + B @ A).to(w.dtype)
            merged[id(layer)] = dataclasses.replace(layer, **new)
        layers.append(merged[id(layer)])
    pooler_weight = base.pooler_weight
    if adapter.pooler is not None:
        pooler_weight = (base.pooler_weight.float() + adapter.pooler[1] @ adapter.pooler[0]).to(base.dtype)
    embeddings = base.embeddings
    tables = {name: (getattr(embeddings, name).float() + (B @ A).T).to(getattr(embeddings, name).dtype)
              for name, (A, B) in adapter.embeddings.items()}
    embeddings = dataclasses.replace(embeddings, **tables)
    if adapter.projection is not None:
        w = embeddings.projection_weight
        embeddings = dataclasses.replace(embeddings, projection_weight=(w.float() + adapter.projection[1]
                                                                         @ adapter.projection[0]).to(w.dtype))
    return dataclasses.replace(base, layers=layers, pooler_weight=pooler_weight, embeddings=embeddings, extra={})


def stack(adapters: Sequence[Adapter], name: str) -> Adapter:
    """Several adapters active at once (PEFT's forward sums their deltas) as one adapter: per slot the ranks of each
    in turn, A's rows and B's columns (scales already in B), so x A^T B^T is the sum of theirs. Slot dicts shared
    between layers (ALBERT) stay shared. Raises LoadError for adapters with head tensors (modules_to_save: PEFT runs
    one adapter's copy at a time) or for other prefixes."""
    if not adapters:
        raise ValueError("stack takes at least one adapter")
    for a in adapters:
        if a.heads or a.head_lora:
            own = ", ".join(sorted([*a.heads, *a.head_lora]))
            raise LoadError(f"adapter {a.name!r} has modules_to_save tensors or LoRA of a head ({own}): adapters "
                            "active together cannot each bring their own copy of a head")
        if a.prefix != adapters[0].prefix or len(a.layers) != len(adapters[0].layers):
            raise LoadError(f"adapters {adapters[0].name!r} and {a.name!r} adapt different models")

    def joined(pairs: list[Pair]) -> Pair:
        return torch.cat([A for A, _ in pairs]).contiguous(), torch.cat([B for _, B in pairs], 1).contiguous()

    seen: dict[tuple, dict[str, Pair]] = {}
    layers = []
    for i in range(len(adapters[0].layers)):
        key = tuple(id(a.layers[i]) for a in adapters)
        if key not in seen:
            slots: dict[str, list[Pair]] = {}
            for a in adapters:
                for slot, pair in a.layers[i].items():
                    slots.setdefault(slot, []).append(pair)
            seen[key] = {slot: joined(pairs) for slot, pairs in slots.items()}
        layers.append(seen[key])
    poolers = [a.pooler for a in adapters if a.pooler is not None]
    projections = [a.projection for a in adapters if a.projection is not None]
    tables: dict[str, list[Pair]] = {}
    for a in adapters:
        for table, pair in a.embeddings.items():
            tables.setdefault(table, []).append(pair)
    return Adapter(name=name, layers=layers, pooler=joined(poolers) if poolers else None,
                   projection=joined(projections) if projections else None,
                   embeddings={table: joined(pairs) for table, pairs in tables.items()},
                   config={"stacked": [a.config for a in adapters]}, prefix=adapters[0].prefix)


def load_adapters(path, base: ModelWeights, name: str) -> Adapter:
    """`load_adapter` of one directory (or `PeftFiles`), or the sum (`stack`) of a list of them; raises LoadError, or
    ValueError for an empty list."""
    if not isinstance(path, (list, tuple)):
        return load_adapter(path, base, name)
    if not path:
        raise ValueError(f"adapter {name!r}: an empty list of adapters to sum")
    return stack([load_adapter(p, base, name) for p in path], name)


def group_rows(cu_seqlens: torch.Tensor, adapters: Sequence[Adapter | None]) -> list[tuple[Adapter, torch.Tensor]]:
    """The packed batch's rows grouped by adapter: (adapter, token indices int64 [n]) per distinct adapter, in order
    of first appearance; rows without an adapter are in no group. cu_seqlens: (batch+1,) int32."""
    if len(adapters) != cu_seqlens.numel() - 1:
        raise ValueError(f"{len(adapters)} adapters for {cu_seqlens.numel() - 1} rows: give one (or None) per row")
    bounds = cu_seqlens.tolist()
    groups: dict[int, tuple[Adapter, list[torch.Tensor]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            groups.setdefault(id(adapter), (adapter, []))[1].append(torch.arange(bounds[i], bounds[i + 1]))
    return [(a, torch.cat(idx)) for a, idx in groups.values()]


def reference_delta(x: torch.Tensor, adapter: Adapter, layer: int, slot: str) -> torch.Tensor | None:
    """x [T, K] through one adapter's slot of executed layer `layer`: (x A^T) B^T in fp32 [T, N], or None where the
    adapter leaves the slot alone."""
    pair = adapter.pooler if slot == "pooler" else adapter.layers[layer].get(slot)
    if pair is None:
        return None
    A, B = pair
    return (x.float() @ A.T) @ B.T


def apply_adapters_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, adapters: Sequence[Adapter | None],
                             layer: int, slot: str, out_features: int) -> torch.Tensor:
    """The per-row delta of one slot over a packed batch: x [T, K] (the slot's input rows), cu_seqlens (batch+1,)
    int32, one adapter or None per row; returns fp32 [T, out_features], each row's delta from its own adapter (zero
    for None or an adapter without the slot). Rows are grouped by adapter, one low-rank product per group: the math
    the engine fuses into the slot's GEMM epilogue (its kernels, unlike torch's, keep a row's bits batch-invariant)."""
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for adapter, idx in group_rows(cu_seqlens, adapters):
        delta = reference_delta(x[idx], adapter, layer, slot)
        if delta is not None:
            out[idx] = delta
    return out


class UnknownAdapter(KeyError):
    """A name that names no loaded adapter (a KeyError whose message reads as a sentence)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


__all__ = ["Adapter", "SLOTS", "UnknownAdapter", "load_adapter", "load_adapters", "merge", "stack", "group_rows",
           "reference_delta", "apply_adapters_reference"]
