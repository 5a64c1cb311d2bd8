"""Model configuration parsed from a Hugging Face ``config.json``.

`ModelConfig` holds only what the engine needs, validated once: an unknown family, activation or
position-embedding type raises `ConfigError` naming the field, so nothing downstream has to guess.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from .kernels.activation import GATED_IDS, HF_NAMES as ACTIVATIONS, LAYER_IDS

# Families whose config and tensor names this version parses. Others raise ConfigError.
SUPPORTED_FAMILIES = ("bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert", "mpnet",
                      "modernbert", "nomic_bert", "gte", "deberta-v2")
# Families with rotary position embeddings (no position table) and a gated FFN (GeGLU / SwiGLU).
ROTARY_FAMILIES = ("modernbert", "nomic_bert", "gte")
# transformers' default RoPE bases when a config names none (ModernBERT: global layers, local layers).
DEFAULT_ROPE_THETA = {"nomic_bert": 1000.0, "gte": 160_000.0, "modernbert": 160_000.0}
DEFAULT_LOCAL_ROPE_THETA = 10_000.0
# Families that derive position ids from input_ids (fairseq style: start after the pad id, skip pads).
POSITIONS_FROM_INPUT_IDS = ("roberta", "xlm-roberta", "mpnet")
# MPNet's embeddings count positions from padding_idx 1 whatever the config's pad_token_id says (transformers
# hard-codes it in MPNetEmbeddings).
MPNET_PADDING_IDX = 1
# MPNet's relative position buckets: transformers' MPNetEncoder.compute_position_bias always buckets with these
# (not with config.relative_attention_num_buckets, which only sizes the bias table), bidirectionally.
RELATIVE_BUCKETS = 32
RELATIVE_MAX_DISTANCE = 128
# DistilBERT spells its config differently: its names -> the BERT names used here.
DISTILBERT_FIELDS = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
                     "hidden_dim": "intermediate_size", "activation": "hidden_act"}

POSITION_EMBEDDING_TYPES = ("absolute",)
# DeBERTa-v2's disentangled attention terms (content-to-position, position-to-content).
POS_ATT_TYPES = ("c2p", "p2c")


class ConfigError(ValueError):
    """A config.json value the engine cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    family: str
    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    activation: str  # engine id: "gelu" | "gelu_tanh" | "relu"
    layer_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int
    position_embedding_type: str = "absolute"
    hidden_act: str = "gelu"  # the Hugging Face spelling, kept for round trips
    embedding_size: int = 0  # ELECTRA / ALBERT factorised embeddings; 0 means hidden_size
    num_hidden_groups: int = 1  # ALBERT: distinct layer groups shared across the depth
    inner_group_num: int = 1  # ALBERT: layers per group
    relative_attention_num_buckets: int = 0  # MPNet: rows of the relative position bias table; 0 = no such bias
    rope_theta: float = 0.0  # RoPE base of the (global) attention layers; 0 = no rotary embeddings
    local_rope_theta: float = 0.0  # ModernBERT: RoPE base of its sliding-window layers
    layer_windows: tuple[int, ...] = ()  # per layer: 0 = global attention, w > 0 = sees tokens |t - u| <= w
    gated_ffn: bool = False  # FFN in = one GEMM of both halves, act(a) * b (GeGLU, SwiGLU)
    norm_first: bool = False  # pre-LayerNorm layers and a final norm (ModernBERT); else post-LayerNorm
    # DeBERTa-v2/v3 (`disentangled`): terms of pos_att_type, and the relative positions' bucketing
    pos_att_type: tuple[str, ...] = ()  # subset of POS_ATT_TYPES; each one also divides the scores' scale
    relative_attention: bool = False  # relative embeddings and position projections exist
    position_buckets: int = 0  # > 0: log buckets, span = position_buckets; 0: span = max_relative_positions
    max_relative_positions: int = 0
    share_att_key: bool = False  # the position projections are the layer's own query / key projections
    norm_rel_ebd: bool = False  # the relative embeddings pass a LayerNorm first
    position_biased_input: bool = True  # absolute position embeddings added to the input (no table when False)

    def __post_init__(self):
        if not self.embedding_size:
            object.__setattr__(self, "embedding_size", self.hidden_size)

    @property
    def positions_from_input_ids(self) -> bool:
        """RoBERTa/XLM-R/MPNet: position ids count real tokens from `position_padding_idx` + 1 (not columns)."""
        return self.family in POSITIONS_FROM_INPUT_IDS

    @property
    def position_padding_idx(self) -> int:
        """The id that marks padding for position ids: pad_token_id, except MPNet's fixed 1."""
        return MPNET_PADDING_IDX if self.family == "mpnet" else self.pad_token_id

    @property
    def max_sequence_length(self) -> int:
        """Longest input a row may have with default position ids."""
        if self.positions_from_input_ids:
            return self.max_position_embeddings - self.position_padding_idx - 1
        return self.max_position_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def disentangled(self) -> bool:
        """DeBERTa-v2's relative attention: per layer, c2p and/or p2c terms added to the attention scores."""
        return self.relative_attention and bool(self.pos_att_type)

    @property
    def att_span(self) -> int:
        """DeBERTa-v2's relative span: relative positions (or buckets) are clamped to [-span, span)."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def attention_scale(self) -> float:
        """The factor of q.k: 1/sqrt(head_dim), DeBERTa-v2's 1/sqrt(head_dim * (1 + len(pos_att_type)))."""
        return 1.0 / math.sqrt(self.head_dim * (1 + len(self.pos_att_type)))

    @property
    def rotary(self) -> bool:
        return self.rope_theta > 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: global)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def rope_base(self, layer: int) -> float:
        """Layer `layer`'s RoPE base: ModernBERT's sliding-window layers have their own (local_rope_theta)."""
        return self.local_rope_theta if self.window(layer) and self.local_rope_theta else self.rope_theta

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Parse a Hugging Face config dict; raises ConfigError naming the offending field."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        family = d.get("model_type")
        if family is None:
            raise ConfigError("config field 'model_type' is missing (expected e.g. 'bert')")
        if family not in SUPPORTED_FAMILIES:
            raise ConfigError(
                f"config field 'model_type' = {family!r} is not a BERT-family encoder "
                f"(supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        if family == "distilbert":
            d = {**d, **{ours: d[theirs] for theirs, ours in DISTILBERT_FIELDS.items() if theirs in d},
                 "layer_norm_eps": 1e-12, "type_vocab_size": 0}

        def need(name, kind=int, default=None, positive=True):
            if name not in d or d[name] is None:
                if default is None:
                    raise ConfigError(f"config field {name!r} is missing")
                return default
            value = d[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"config field {name!r} must be a number, got {value!r}")
            if positive and not value > 0:
                raise ConfigError(f"config field {name!r} must be positive, got {value!r}")
            return kind(value)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if hidden % heads:
            raise ConfigError(
                f"config field 'hidden_size' = {hidden} is not a multiple of "
                f"'num_attention_heads' = {heads}"
            )
        act_field = "hidden_activation" if family == "modernbert" else "hidden_act"
        act = d.get(act_field, "gelu_new" if family == "albert" else "gelu")
        allowed = GATED_IDS if family in ROTARY_FAMILIES else LAYER_IDS
        if not isinstance(act, str) or ACTIVATIONS.get(act) not in allowed:
            raise ConfigError(
                f"config field {act_field!r} = {act!r} is not supported "
                f"(supported: {', '.join(n for n, i in ACTIVATIONS.items() if i in allowed)})"
            )
        pos_type = d.get("position_embedding_type", "absolute") or "absolute"
        if pos_type not in POSITION_EMBEDDING_TYPES:
            raise ConfigError(
                f"config field 'position_embedding_type' = {pos_type!r} is not supported "
                f"(supported: {', '.join(POSITION_EMBEDDING_TYPES)})"
            )
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ConfigError("config field 'is_decoder'/'add_cross_attention' is set: bertfast serves encoders only")
        if family == "mpnet":  # no token types; a relative position bias table of at least the 32 buckets used
            d = {**d, "type_vocab_size": 0}
            buckets = need("relative_attention_num_buckets", default=RELATIVE_BUCKETS)
            if buckets < RELATIVE_BUCKETS:
                raise ConfigError(
                    f"config field 'relative_attention_num_buckets' = {buckets} is below the {RELATIVE_BUCKETS} "
                    f"buckets transformers' MPNet computes relative positions into")
        extra = _rotary_fields(family, d, hidden, heads) if family in ROTARY_FAMILIES else {}
        if family == "deberta-v2":  # no token types unless the config says so; its own eps default
            d = {"type_vocab_size": 0, "layer_norm_eps": 1e-7, **d}
            extra = _deberta_fields(d, hidden, heads)
        if family == "modernbert":  # its own names for the norm eps; no token types
            d = {**d, "layer_norm_eps": d.get("norm_eps", 1e-5), "type_vocab_size": 0}
        if family in ROTARY_FAMILIES:  # no position table: transformers takes any length up to the config's
            d = {**d, "max_position_embeddings": d.get("max_position_embeddings") or 8192}
        pad = d.get("pad_token_id", 0)
        if pad is None:
            pad = 0
        return cls(
            family=family,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_hidden_layers=need("num_hidden_layers"),
            intermediate_size=need("intermediate_size"),
            activation=ACTIVATIONS[act],
            layer_norm_eps=need("layer_norm_eps", float, default=1e-12),
            vocab_size=need("vocab_size"),
            max_position_embeddings=need("max_position_embeddings", default=512),
            type_vocab_size=need("type_vocab_size", default=2, positive=False),
            pad_token_id=int(pad),
            position_embedding_type=pos_type,
            hidden_act=act,
            embedding_size=need("embedding_size", default=hidden) if family in ("electra", "albert") else hidden,
            num_hidden_groups=need("num_hidden_groups", default=1) if family == "albert" else 1,
            inner_group_num=need("inner_group_num", default=1) if family == "albert" else 1,
            relative_attention_num_buckets=buckets if family == "mpnet" else 0,
            **extra,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        return cls.from_dict(read_config_json(path))


def _rotary_fields(family: str, d: dict, hidden: int, heads: int) -> dict:
    """RoPE bases, attention windows, gating and norm placement of a rotary family's config (transformers'
    `rope_parameters`, or the older `rope_theta` / `global_rope_theta` / `local_rope_theta` fields)."""
    if d.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"config field 'head_dim' = {d['head_dim']!r} differs from hidden_size / num_attention_heads "
                          f"= {hidden // heads}: not supported")
    params = d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    if d.get("rope_scaling"):
        raise ConfigError(f"config field 'rope_scaling' = {d['rope_scaling']!r} is not supported (plain RoPE only)")

    def theta(entry: dict, fallback: float, where: str) -> float:
        if entry.get("rope_type", "default") != "default":
            raise ConfigError(f"config field '{where}' has rope_type {entry['rope_type']!r}: only 'default' "
                              "(unscaled) RoPE is supported")
        for key in ("partial_rotary_factor",):
            if entry.get(key, 1.0) != 1.0:
                raise ConfigError(f"config field '{where}.{key}' = {entry[key]!r} is not supported "
                                  "(full-dim RoPE only)")
        value = entry.get("rope_theta", fallback)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"config field '{where}.rope_theta' must be a positive number, got {value!r}")
        return float(value)

    layers = d.get("num_hidden_layers")
    if family != "modernbert":
        base = theta(params, d.get("rope_theta", DEFAULT_ROPE_THETA[family]), "rope_parameters")
        return dict(rope_theta=base, gated_ffn=True)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise ConfigError(f"config field 'num_hidden_layers' must be a positive integer, got {layers!r}")
    types = d.get("layer_types")
    if types is None:
        every = d.get("global_attn_every_n_layers", 3)
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ConfigError(f"config field 'layer_types' must list 'full_attention' / 'sliding_attention' once per layer "
                          f"({layers}), got {types!r}")
    local = d.get("local_attention", 128)
    if isinstance(local, bool) or not isinstance(local, int) or local < 2:
        raise ConfigError(f"config field 'local_attention' must be an integer >= 2, got {local!r}")
    for flag in ("attention_bias", "mlp_bias", "norm_bias"):
        if not isinstance(d.get(flag, False), bool):
            raise ConfigError(f"config field {flag!r} must be true or false, got {d[flag]!r}")
    full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    return dict(
        rope_theta=theta(full, d.get("global_rope_theta", DEFAULT_ROPE_THETA[family]),
                         "rope_parameters.full_attention"),
        local_rope_theta=theta(sliding, d.get("local_rope_theta", DEFAULT_LOCAL_ROPE_THETA),
                               "rope_parameters.sliding_attention"),
        layer_windows=tuple(local // 2 if t == "sliding_attention" else 0 for t in types),
        gated_ffn=True, norm_first=True)


def _deberta_fields(d: dict, hidden: int, heads: int) -> dict:
    """DeBERTa-v2/v3 (and mDeBERTa): the disentangled attention's fields, as transformers' DebertaV2Model reads
    them (`pos_att_type` a list or "a|b"; max_relative_positions < 1 means max_position_embeddings). What the
    engine does not implement raises ConfigError naming the field."""
    def flag(name, default):
        value = d.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"config field {name!r} must be true or false, got {value!r}")
        return value

    def integer(name, default):
        value = d.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
        return value

    types = d.get("pos_att_type") or []
    if isinstance(types, str):
        types = [t.strip() for t in types.lower().split("|")]
    if not isinstance(types, (list, tuple)) or any(t not in POS_ATT_TYPES for t in types):
        raise ConfigError(f"config field 'pos_att_type' = {d.get('pos_att_type')!r} is not supported "
                          f"(supported: a list of {', '.join(POS_ATT_TYPES)})")
    if integer("conv_kernel_size", 0) > 0:
        raise ConfigError(f"config field 'conv_kernel_size' = {d['conv_kernel_size']!r}: DeBERTa's convolution "
                          "layer (ConvLayer after the first layer) is not supported")
    if integer("embedding_size", hidden) != hidden:
        raise ConfigError(f"config field 'embedding_size' = {d['embedding_size']!r} differs from hidden_size = "
                          f"{hidden}: DeBERTa's embedding projection is not supported")
    if integer("attention_head_size", hidden // heads) != hidden // heads:
        raise ConfigError(f"config field 'attention_head_size' = {d['attention_head_size']!r} differs from "
                          f"hidden_size / num_attention_heads = {hidden // heads}: not supported")
    norm = d.get("norm_rel_ebd", "none") or "none"
    if not isinstance(norm, str) or any(n.strip() not in ("none", "layer_norm") for n in norm.lower().split("|")):
        raise ConfigError(f"config field 'norm_rel_ebd' = {norm!r} is not supported (supported: none, layer_norm)")
    relative = flag("relative_attention", False)
    max_relative = integer("max_relative_positions", -1)
    if max_relative < 1:
        max_relative = integer("max_position_embeddings", 512)
    buckets = max(integer("position_buckets", -1), 0)
    if relative and types and (max_relative < 2 or buckets == 1):
        raise ConfigError(f"config fields 'max_relative_positions' = {max_relative} / 'position_buckets' = {buckets}: "
                          "too small for relative positions")
    return dict(pos_att_type=tuple(t for t in POS_ATT_TYPES if t in types), relative_attention=relative,
                position_buckets=buckets, max_relative_positions=max_relative,
                share_att_key=flag("share_att_key", False),
                norm_rel_ebd="layer_norm" in [n.strip() for n in norm.lower().split("|")],
                position_biased_input=flag("position_biased_input", True))


def read_config_json(path: str | os.PathLike) -> dict:
    """The JSON object in `path` (a config.json, or a directory holding one); ConfigError otherwise."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d
