"""Weight loading: checkpoint files or an in-memory Hugging Face model -> `ModelWeights`.

Everything is checked before anything is returned: each tensor is looked up by name, its shape is
compared with what the config implies, and its dtype must be a float type. Q, K and V are fused
into one ``[3H, H]`` matrix (and ``[3H]`` bias) here, once. A failure raises `LoadError` naming the
tensor or file; no partially loaded object ever escapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Mapping

import torch

from . import disentangled
from .backends.weights import EmbeddingWeights, LayerWeights, ModelWeights
from .config import ConfigError, ModelConfig

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
               "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp64": torch.float64, "float64": torch.float64}

# Where each family keeps its encoder inside task checkpoints (base checkpoints use no prefix).
BASE_PREFIX = {"bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.", "electra": "electra.",
               "albert": "albert.", "distilbert": "distilbert.", "mpnet": "mpnet.", "modernbert": "model.",
               "nomic_bert": "nomic_bert.", "gte": "gte.", "deberta-v2": "deberta."}

# Per family: module names (without .weight/.bias) of one layer's parts, relative to the layer.
_BERT_LAYER = dict(query="attention.self.query", key="attention.self.key", value="attention.self.value",
                   attn_out="attention.output.dense", attn_ln="attention.output.LayerNorm",
                   ffn_in="intermediate.dense", ffn_out="output.dense", ffn_ln="output.LayerNorm")
LAYER_NAMES = {
    "bert": _BERT_LAYER, "roberta": _BERT_LAYER, "xlm-roberta": _BERT_LAYER, "electra": _BERT_LAYER,
    "albert": dict(query="attention.query", key="attention.key", value="attention.value",
                   attn_out="attention.dense", attn_ln="attention.LayerNorm",
                   ffn_in="ffn", ffn_out="ffn_output", ffn_ln="full_layer_layer_norm"),
    "distilbert": dict(query="attention.q_lin", key="attention.k_lin", value="attention.v_lin",
                       attn_out="attention.out_lin", attn_ln="sa_layer_norm",
                       ffn_in="ffn.lin1", ffn_out="ffn.lin2", ffn_ln="output_layer_norm"),
    "mpnet": {**_BERT_LAYER, "query": "attention.attn.q", "key": "attention.attn.k", "value": "attention.attn.v",
              "attn_out": "attention.attn.o", "attn_ln": "attention.LayerNorm"},
    "deberta-v2": {**_BERT_LAYER, "query": "attention.self.query_proj", "key": "attention.self.key_proj",
                   "value": "attention.self.value_proj"},
}
# Rotary families (gated FFN, no position table): each checkpoint layout's names. A layout fuses QKV ("qkv", rows
# q | k | v) or not ("query", "key", "value"), and the FFN input ("ffn_in", with the row order of its two halves:
# "gate_up" = the activated half first) or not ("gate", "up"). The hub layouts are what the models' own repos and
# transformers' save_pretrained write; the transformers layouts are its module names (in-memory models).
_LAYER_TF = dict(query="self_attn.q_proj", key="self_attn.k_proj", value="self_attn.v_proj",
                 attn_out="self_attn.o_proj", attn_ln="post_attention_layernorm", gate="mlp.gate_proj",
                 up="mlp.up_proj", ffn_out="mlp.down_proj", ffn_ln="post_mlp_layernorm")
_BERT_EMBED = dict(word="embeddings.word_embeddings", token_type="embeddings.token_type_embeddings",
                   embed_ln="embeddings.LayerNorm")
ROTARY_LAYOUTS = {
    "nomic_bert": [
        dict(_BERT_EMBED, embed_ln="emb_ln", layers="encoder.layers.",
             layer=dict(qkv="attn.Wqkv", attn_out="attn.out_proj", attn_ln="norm1", gate="mlp.fc12", up="mlp.fc11",
                        ffn_out="mlp.fc2", ffn_ln="norm2")),
        dict(_BERT_EMBED, layers="layers.", layer=_LAYER_TF)],
    "gte": [
        dict(_BERT_EMBED, layers="encoder.layer.",
             layer=dict(qkv="attention.qkv_proj", attn_out="attention.o_proj", attn_ln="attn_ln",
                        ffn_in="mlp.up_gate_proj", ffn_order="up_gate", ffn_out="mlp.down_proj", ffn_ln="mlp_ln")),
        dict(_BERT_EMBED, layers="layers.", layer=_LAYER_TF)],
    "modernbert": [
        dict(word="embeddings.tok_embeddings", embed_ln="embeddings.norm", final_ln="final_norm", layers="layers.",
             layer=dict(qkv="attn.Wqkv", attn_out="attn.Wo", attn_ln="attn_norm", ffn_in="mlp.Wi", ffn_order="gate_up",
                        ffn_out="mlp.Wo", ffn_ln="mlp_norm"))],
}
# Other prefixes of the encoder inside task checkpoints (GTE's own repos: "new.").
EXTRA_PREFIXES = {"gte": ("new.",)}
# MPNet's relative position bias table (an Embedding [buckets, heads]), shared by every layer.
RELATIVE_BIAS = {"mpnet": "encoder.relative_attention_bias.weight"}
# Embedding -> hidden projection (factorised embeddings) and pooler module names, per family.
PROJECTION = {"electra": "embeddings_project", "albert": "encoder.embedding_hidden_mapping_in"}
POOLER = {"bert": "pooler.dense", "roberta": "pooler.dense", "xlm-roberta": "pooler.dense", "albert": "pooler",
          "mpnet": "pooler.dense", "nomic_bert": "pooler.dense", "gte": "pooler.dense"}


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor or file."""


def resolve_dtype(dtype) -> torch.dtype | None:
    """Accepts None, a torch float dtype, or a name like 'bf16'; raises ValueError otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(
        f"dtype {dtype!r} is not supported (use one of torch.float32, torch.float16, torch.bfloat16, "
        f"or the names {', '.join(sorted(DTYPE_NAMES))})"
    )


# --------------------------------------------------------------------------------------------
# Reading tensors from files


class _TensorSource:
    """Name -> tensor lookup over one checkpoint (lazy for safetensors)."""

    def __init__(self, names: Mapping[str, str], read: Callable[[str], torch.Tensor]):
        self.names = names  # tensor name -> file it lives in (for messages)
        self._read = read

    def __contains__(self, name):
        return name in self.names

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._read(name)
        except Exception as e:  # corrupt or truncated data surfaces here for lazy formats
            raise LoadError(f"cannot read tensor {name!r} from {self.names[name]}: {e}") from None


def _safetensors_source(files: list[str]) -> _TensorSource:
    from safetensors import safe_open

    handles, names = {}, {}
    for path in files:
        if not os.path.isfile(path):
            raise LoadError(f"weights file {path} is missing")
        try:
            handle = safe_open(path, framework="pt")
            keys = list(handle.keys())
        except Exception as e:
            raise LoadError(f"{path} is not a valid safetensors file (corrupt or truncated?): {e}") from None
        size = os.path.getsize(path)
        for k in keys:
            names[k] = path
            handles[k] = handle
        # safetensors maps lazily; a truncated file is caught by checking the data end offsets.
        _check_safetensors_extent(path, size)
    return _TensorSource(names, lambda k: handles[k].get_tensor(k))


def _check_safetensors_extent(path: str, size: int) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoadError(f"{path} is truncated (no safetensors header)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise LoadError(f"{path} is truncated or corrupt (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except Exception as e:
            raise LoadError(f"{path} has a corrupt safetensors header: {e}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise LoadError(f"{path} is truncated: tensors need {8 + n + end} bytes, the file has {size}")


def _torch_bin_source(files: list[str]) -> _TensorSource:
    tensors, names = {}, {}
    for path in files:
        if not os.path.isfile(path):
            raise LoadError(f"weights file {path} is missing")
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise LoadError(f"cannot load {path} (corrupt, truncated, or not a plain state dict): {e}") from None
        if not isinstance(sd, Mapping):
            raise LoadError(f"{path} does not hold a state dict (found {type(sd).__name__})")
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                tensors[k], names[k] = v, path
    return _TensorSource(names, tensors.__getitem__)


def _sharded_files(index_path: str) -> list[str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except Exception as e:
        raise LoadError(f"{index_path} is not a valid shard index: {e}") from None
    folder = os.path.dirname(index_path)
    return [os.path.join(folder, name) for name in dict.fromkeys(weight_map.values())]


def open_checkpoint(directory: str) -> _TensorSource:
    """Find the weights in a Hugging Face model directory and open them for lookup."""
    candidates = [
        ("model.safetensors", lambda p: _safetensors_source([p])),
        ("model.safetensors.index.json", lambda p: _safetensors_source(_sharded_files(p))),
        ("pytorch_model.bin", lambda p: _torch_bin_source([p])),
        ("pytorch_model.bin.index.json", lambda p: _torch_bin_source(_sharded_files(p))),
    ]
    for name, opener in candidates:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return opener(path)
    raise LoadError(
        f"no weights in {directory}: expected one of {', '.join(n for n, _ in candidates)}"
    )


# --------------------------------------------------------------------------------------------
# Assembling ModelWeights


def _lookup(src, prefix: str, name: str) -> str | None:
    """Full tensor name for `name` under `prefix`, accepting old LayerNorm gamma/beta spellings."""
    full = prefix + name
    if full in src:
        return full
    for new, old in ((".weight", ".gamma"), (".bias", ".beta")):
        if "LayerNorm" in name and name.endswith(new):
            legacy = prefix + name[: -len(new)] + old
            if legacy in src:
                return legacy
    return None


def _detect_prefix(src, config: ModelConfig) -> str:
    probe = "embeddings.word_embeddings.weight"
    prefixes = ("", BASE_PREFIX[config.family])
    for prefix in prefixes:
        if prefix + probe in src:
            return prefix
    raise LoadError(
        f"tensor {probe!r} not found under any of the prefixes {', '.join(repr(p) for p in prefixes)}: "
        f"this is not a {config.family} checkpoint"
    )


def _layer_prefixes(config: ModelConfig) -> list[str]:
    """Prefix of each executed layer's tensors, in execution order (ALBERT repeats its groups)."""
    if config.family == "distilbert":
        return [f"transformer.layer.{i}." for i in range(config.num_hidden_layers)]
    if config.family != "albert":
        return [f"encoder.layer.{i}." for i in range(config.num_hidden_layers)]
    L, G = config.num_hidden_layers, config.num_hidden_groups
    return [f"encoder.albert_layer_groups.{int(i / (L / G))}.albert_layers.{j}."
            for i in range(L) for j in range(config.inner_group_num)]


def _getter(src, prefix: str):
    """get(name, shape, optional=False): the tensor `prefix + name`, its shape and float dtype checked."""

    def get(name, shape, optional=False):
        full = _lookup(src, prefix, name)
        if full is None:
            if optional:
                return None
            raise LoadError(f"tensor {prefix + name!r} is missing from the checkpoint")
        t = src.get(full)
        if tuple(t.shape) != tuple(shape):
            raise LoadError(
                f"tensor {full!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from config.json"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise LoadError(f"tensor {full!r} has dtype {t.dtype}, expected a floating point dtype")
        return t

    return get


def assemble(src, config: ModelConfig, dtype: torch.dtype | None = None, stream_dtype=None) -> ModelWeights:
    """Build ModelWeights from a tensor source, checking names, shapes and dtypes; stream_dtype: `ModelWeights.to`."""
    if config.rotary:
        weights = _assemble_rotary(src, config)
        return weights.to(dtype=dtype or weights.dtype, stream_dtype=stream_dtype)
    prefix = _detect_prefix(src, config)
    H, I, E = config.hidden_size, config.intermediate_size, config.embedding_size
    get = _getter(src, prefix)

    def linear(module, out_features, in_features=None, optional=False):
        """(weight, bias) of a Linear, or of a LayerNorm when in_features is None."""
        w_shape = (out_features,) if in_features is None else (out_features, in_features)
        w = get(module + ".weight", w_shape, optional)
        b = get(module + ".bias", (out_features,), optional)
        if (w is None) != (b is None):
            raise LoadError(f"{prefix}{module} is half present: need both .weight and .bias")
        return w, b

    projection = (None, None)
    if config.family in PROJECTION and (config.family == "albert" or E != H):
        projection = linear(PROJECTION[config.family], H, E)
    embeddings = EmbeddingWeights(
        word=get("embeddings.word_embeddings.weight", (config.vocab_size, E)),
        position=(get("embeddings.position_embeddings.weight", (config.max_position_embeddings, E))
                  if config.position_biased_input else None),
        token_type=(get("embeddings.token_type_embeddings.weight", (config.type_vocab_size, E))
                    if config.type_vocab_size else None),
        ln_weight=get("embeddings.LayerNorm.weight", (E,)),
        ln_bias=get("embeddings.LayerNorm.bias", (E,)),
        projection_weight=projection[0],
        projection_bias=projection[1],
        relative_bias=(get(RELATIVE_BIAS[config.family], (config.relative_attention_num_buckets,
                                                          config.num_attention_heads))
                       if config.family in RELATIVE_BIAS else None),
    )
    names = LAYER_NAMES[config.family]
    built: dict[str, LayerWeights] = {}  # shared (ALBERT) layers are built once and reused
    layers = []
    for p in _layer_prefixes(config):
        if p not in built:
            q, k, v = (linear(p + names[n], H, H) for n in ("query", "key", "value"))
            attn_out, ffn_in, ffn_out = (linear(p + names["attn_out"], H, H), linear(p + names["ffn_in"], I, H),
                                         linear(p + names["ffn_out"], H, I))
            attn_ln, ffn_ln = linear(p + names["attn_ln"], H), linear(p + names["ffn_ln"], H)
            built[p] = LayerWeights(
                qkv_weight=torch.cat([q[0], k[0], v[0]], 0),
                qkv_bias=torch.cat([q[1], k[1], v[1]], 0),
                attn_out_weight=attn_out[0], attn_out_bias=attn_out[1],
                attn_ln_weight=attn_ln[0], attn_ln_bias=attn_ln[1],
                ffn_in_weight=ffn_in[0], ffn_in_bias=ffn_in[1],
                ffn_out_weight=ffn_out[0], ffn_out_bias=ffn_out[1],
                ffn_ln_weight=ffn_ln[0], ffn_ln_bias=ffn_ln[1],
            )
        layers.append(built[p])
    if config.disentangled:
        layers, embeddings.relative_inputs = _disentangled_positions(get, linear, config, layers)
    pooler = (None, None)
    if config.family in POOLER:
        pooler = linear(POOLER[config.family], H, H, optional=True)
    weights = ModelWeights(config, embeddings, layers, *pooler)
    # One dtype throughout, the checkpoint's (of the word embeddings) unless asked otherwise; stream tensors aside.
    return weights.to(dtype=dtype or weights.dtype, stream_dtype=stream_dtype)


def _disentangled_positions(get, linear, config: ModelConfig, layers: list[LayerWeights]):
    """DeBERTa-v2: (the layers with their projections of the relative embeddings (`disentangled`): own pos_key_proj /
    pos_query_proj, or with share_att_key the layer's key / query projections; the projections' input)."""
    H, out = config.hidden_size, []
    rel = get("encoder.rel_embeddings.weight", (2 * config.att_span, H))
    ln = linear("encoder.LayerNorm", H) if config.norm_rel_ebd else (None, None)
    for i, layer in enumerate(layers):
        own = f"encoder.layer.{i}.attention.self."
        key = query = None
        if "c2p" in config.pos_att_type:
            key = ((layer.qkv_weight[H:2 * H], layer.qkv_bias[H:2 * H]) if config.share_att_key
                   else linear(own + "pos_key_proj", H, H))
        if "p2c" in config.pos_att_type:
            query = ((layer.qkv_weight[:H], layer.qkv_bias[:H]) if config.share_att_key
                     else linear(own + "pos_query_proj", H, H))
        pos_key, pos_query = disentangled.position_projections(config, rel, *ln, key, query)
        out.append(dataclasses.replace(layer, pos_key=pos_key, pos_query=pos_query))
    return out, disentangled.position_inputs(config, rel, *ln).to(rel.dtype)


def _rotary_layout(src, config: ModelConfig) -> tuple[str, dict]:
    """(prefix, layout) of a rotary family's checkpoint: the first layout whose word embeddings and first layer
    are found under one of the family's prefixes."""
    prefixes = ("", BASE_PREFIX[config.family]) + EXTRA_PREFIXES.get(config.family, ())
    layouts = ROTARY_LAYOUTS[config.family]
    for layout in layouts:
        part = layout["layer"]
        first = f"{layout['layers']}0.{part['qkv'] if 'qkv' in part else part['query']}.weight"
        for prefix in prefixes:
            if prefix + layout["word"] + ".weight" in src and prefix + first in src:
                return prefix, layout
    probes = " or ".join(repr(layout["word"] + ".weight") for layout in layouts)
    raise LoadError(f"tensor {probes} (with its first layer) not found under any of the prefixes "
                    f"{', '.join(repr(p) for p in prefixes)}: this is not a {config.family} checkpoint")


def _assemble_rotary(src, config: ModelConfig) -> ModelWeights:
    """ModernBERT, NomicBERT, GTE: no position table, gated FFN (rows: activated half | other half), linear biases
    where the checkpoint has them (None otherwise), LayerNorm biases zero where it has none."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    prefix, names = _rotary_layout(src, config)
    get = _getter(src, prefix)

    def linear(module, rows, cols):  # (rows, cols) weight, (rows,) bias or None
        return get(module + ".weight", (rows, cols)), get(module + ".bias", (rows,), optional=True)

    def norm(module, optional=False):
        w = get(module + ".weight", (H,), optional)
        if w is None:
            return None, None
        b = get(module + ".bias", (H,), optional=True)
        return w, torch.zeros_like(w) if b is None else b

    def fuse(module, parts):
        """Row-concatenated weights and biases of `parts` ((weight, bias) pairs)."""
        biases = [b for _, b in parts]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise LoadError(f"{prefix}{module}: some of the fused projections have a bias and some do not")
        return torch.cat([w for w, _ in parts], 0), None if biases[0] is None else torch.cat(biases, 0)

    def swap_halves(pair):
        return tuple(None if t is None else torch.cat(t.chunk(2, 0)[::-1], 0) for t in pair)

    word = get(names["word"] + ".weight", (V, H))
    token_type = None
    if "token_type" in names and config.type_vocab_size:
        token_type = get(names["token_type"] + ".weight", (config.type_vocab_size, H))
    embed_ln = norm(names["embed_ln"])
    embeddings = EmbeddingWeights(word=word, position=None, token_type=token_type, ln_weight=embed_ln[0],
                                  ln_bias=embed_ln[1])
    part = names["layer"]
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"{names['layers']}{i}."
        if "qkv" in part:
            qkv = linear(p + part["qkv"], 3 * H, H)
        else:
            qkv = fuse(p + part["query"], [linear(p + part[n], H, H) for n in ("query", "key", "value")])
        if "ffn_in" in part:
            ffn_in = linear(p + part["ffn_in"], 2 * I, H)
            ffn_in = swap_halves(ffn_in) if part["ffn_order"] == "up_gate" else ffn_in
        else:
            ffn_in = fuse(p + part["gate"], [linear(p + part[n], I, H) for n in ("gate", "up")])
        attn_ln = norm(p + part["attn_ln"], optional=config.norm_first and i == 0)  # ModernBERT: none in layer 0
        attn_out, ffn_out = linear(p + part["attn_out"], H, H), linear(p + part["ffn_out"], H, I)
        ffn_ln = norm(p + part["ffn_ln"])
        layers.append(LayerWeights(
            qkv_weight=qkv[0], qkv_bias=qkv[1], attn_out_weight=attn_out[0], attn_out_bias=attn_out[1],
            attn_ln_weight=attn_ln[0], attn_ln_bias=attn_ln[1], ffn_in_weight=ffn_in[0], ffn_in_bias=ffn_in[1],
            ffn_out_weight=ffn_out[0], ffn_out_bias=ffn_out[1], ffn_ln_weight=ffn_ln[0], ffn_ln_bias=ffn_ln[1]))
    final = norm(names["final_ln"]) if "final_ln" in names else (None, None)
    pooler = (None, None)
    if config.family in POOLER and _lookup(src, prefix, POOLER[config.family] + ".weight") is not None:
        pooler = linear(POOLER[config.family], H, H)  # NomicBERT / GTE sequence classification
    return ModelWeights(config, embeddings, layers, *pooler, final_ln_weight=final[0], final_ln_bias=final[1])


def load_pretrained(directory: str | os.PathLike, dtype=None, stream_dtype=None) -> ModelWeights:
    """Load a Hugging Face model directory (config.json + safetensors / pytorch_model.bin); stream_dtype: `assemble`."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise LoadError(f"model directory {directory} does not exist")
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_json(directory)
    return assemble(open_checkpoint(directory), config, dtype, stream_dtype)


def load_hf_model(model, dtype=None, stream_dtype=None) -> ModelWeights:
    """Load the encoder weights of an in-memory `transformers` model (base or task model); stream_dtype: `assemble`."""
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(model, "state_dict"):
        raise LoadError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_dict(hf_config.to_dict())
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    src = _TensorSource({k: "the in-memory model" for k in sd}, sd.__getitem__)
    return assemble(src, config, dtype, stream_dtype)


__all__ = [
    "EmbeddingWeights", "LayerWeights", "ModelWeights", "LoadError", "ConfigError",
    "load_pretrained", "load_hf_model", "assemble", "open_checkpoint", "resolve_dtype",
]
