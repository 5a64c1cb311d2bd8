"""Shared input builders for benchmarks and tests: model configs by name, random weights, batches.

Everything here is deterministic given its seed, so a benchmark row and a test case built with the
same arguments see the same tensors. Batches are right-padded (B, S) int64 triples
(input_ids, attention_mask, token_type_ids) whose real lengths follow a named distribution; `S` is
always the padded length. Per-op FLOP and byte counts (`op_cost`) live here too, so the op benchmarks
and the roofline notes use one formula.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from bertfast.config import ModelConfig
from bertfast.backends.weights import EmbeddingWeights, LayerWeights, ModelWeights

# Hugging Face config fields of the named random-weight models. "minilm" has the shape of the
# embedded all-MiniLM-L6-v2 checkpoint; "tiny" is small enough for interpreted kernels in tests.
CONFIGS: dict[str, dict] = {
    "bert-base": dict(hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                      intermediate_size=3072, vocab_size=30522),
    "minilm": dict(hidden_size=384, num_attention_heads=12, num_hidden_layers=6,
                   intermediate_size=1536, vocab_size=30522),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 intermediate_size=128, vocab_size=1000),
    # Other families at their base checkpoints' shapes (all-mpnet-base-v2, ModernBERT-base,
    # nomic-embed-text-v1.5, gte-base-en-v1.5, deberta-v3-base): random transformers models of their own classes.
    "mpnet-base": dict(model_type="mpnet", hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                       intermediate_size=3072, vocab_size=30527, max_position_embeddings=514, pad_token_id=1,
                       layer_norm_eps=1e-5),
    "modernbert-base": dict(model_type="modernbert", hidden_size=768, num_attention_heads=12, num_hidden_layers=22,
                            intermediate_size=1152, vocab_size=50368, max_position_embeddings=8192,
                            pad_token_id=50283, local_attention=128, global_attn_every_n_layers=3),
    "nomic-bert": dict(model_type="nomic_bert", hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                       intermediate_size=3072, vocab_size=30528, max_position_embeddings=2048, type_vocab_size=2),
    "gte-base": dict(model_type="gte", hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                     intermediate_size=3072, vocab_size=30528, max_position_embeddings=8192, type_vocab_size=0,
                     pad_token_id=0),
    # deberta-v3-base: disentangled attention over 256 log buckets, shared keys, no absolute positions.
    "deberta-v3-base": dict(model_type="deberta-v2", hidden_size=768, num_attention_heads=12, num_hidden_layers=12,
                            intermediate_size=3072, vocab_size=128100, max_position_embeddings=512, type_vocab_size=0,
                            pad_token_id=0, hidden_act="gelu", layer_norm_eps=1e-7, relative_attention=True,
                            position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
                            share_att_key=True, pos_att_type="p2c|c2p", position_biased_input=False),
}
_COMMON = dict(model_type="bert", hidden_act="gelu", layer_norm_eps=1e-12, max_position_embeddings=512,
               type_vocab_size=2, pad_token_id=0, position_embedding_type="absolute")

LENGTH_DISTRIBUTIONS = ("full", "uniform", "ragged", "short")  # and "ragged<N>": "ragged" from N tokens
RAGGED_MIN = 16  # the shortest length of the "ragged" distribution ("ragged<N>": N)


def hf_config_dict(name: str) -> dict:
    """The Hugging Face config dict (model_type, sizes, ...) of a named random-weight model."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    if "model_type" in CONFIGS[name]:  # another family: its own transformers defaults fill the rest
        return dict(CONFIGS[name])
    return {**_COMMON, **CONFIGS[name]}


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(hf_config_dict(name))


# ----------------------------------------------------------------------------------------------
# Random weights


def random_state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face `BertModel` state dict (fp32) with random values for config `name`.

    Biases and LayerNorm parameters are random too (not 0 and 1 as at initialisation), so an
    engine that drops a bias or swaps gamma and beta gives a visibly wrong output.
    """
    cfg = hf_config_dict(name)
    if cfg["model_type"] != "bert":
        return random_hf_model(name, seed).state_dict()
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def ln(n):
        return 1.0 + w(n, std=0.1), w(n, std=0.05)

    sd = {
        "embeddings.word_embeddings.weight": w(cfg["vocab_size"], H),
        "embeddings.position_embeddings.weight": w(cfg["max_position_embeddings"], H),
        "embeddings.token_type_embeddings.weight": w(cfg["type_vocab_size"], H),
    }
    sd["embeddings.LayerNorm.weight"], sd["embeddings.LayerNorm.bias"] = ln(H)
    for i in range(L):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            sd[p + f"attention.self.{n}.weight"] = w(H, H)
            sd[p + f"attention.self.{n}.bias"] = w(H)
        sd[p + "attention.output.dense.weight"] = w(H, H)
        sd[p + "attention.output.dense.bias"] = w(H)
        sd[p + "attention.output.LayerNorm.weight"], sd[p + "attention.output.LayerNorm.bias"] = ln(H)
        sd[p + "intermediate.dense.weight"] = w(I, H)
        sd[p + "intermediate.dense.bias"] = w(I)
        sd[p + "output.dense.weight"] = w(H, I)
        sd[p + "output.dense.bias"] = w(H)
        sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"] = ln(H)
    sd["pooler.dense.weight"] = w(H, H)
    sd["pooler.dense.bias"] = w(H)
    return sd


def random_weights(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device="cpu") -> ModelWeights:
    """`ModelWeights` with the same values as `random_hf_model(name, seed)` (no transformers needed for BERT
    configs)."""
    if hf_config_dict(name)["model_type"] != "bert":
        from bertfast.loading import load_hf_model

        return load_hf_model(random_hf_model(name, seed)).to(dtype=dtype, device=device)
    config = model_config(name)
    sd = random_state_dict(name, seed)
    emb = EmbeddingWeights(
        word=sd["embeddings.word_embeddings.weight"],
        position=sd["embeddings.position_embeddings.weight"],
        token_type=sd["embeddings.token_type_embeddings.weight"],
        ln_weight=sd["embeddings.LayerNorm.weight"],
        ln_bias=sd["embeddings.LayerNorm.bias"],
    )
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        s = p + "attention.self."
        layers.append(LayerWeights(
            qkv_weight=torch.cat([sd[s + n + ".weight"] for n in ("query", "key", "value")]),
            qkv_bias=torch.cat([sd[s + n + ".bias"] for n in ("query", "key", "value")]),
            attn_out_weight=sd[p + "attention.output.dense.weight"],
            attn_out_bias=sd[p + "attention.output.dense.bias"],
            attn_ln_weight=sd[p + "attention.output.LayerNorm.weight"],
            attn_ln_bias=sd[p + "attention.output.LayerNorm.bias"],
            ffn_in_weight=sd[p + "intermediate.dense.weight"],
            ffn_in_bias=sd[p + "intermediate.dense.bias"],
            ffn_out_weight=sd[p + "output.dense.weight"],
            ffn_out_bias=sd[p + "output.dense.bias"],
            ffn_ln_weight=sd[p + "output.LayerNorm.weight"],
            ffn_ln_bias=sd[p + "output.LayerNorm.bias"],
        ))
    weights = ModelWeights(config, emb, layers, sd["pooler.dense.weight"], sd["pooler.dense.bias"])
    return weights.to(dtype=dtype, device=device)


def random_hf_model(name: str, seed: int = 0, attn_implementation: str = "eager"):
    """A `transformers.BertModel` (fp32, eval mode) holding `random_state_dict(name, seed)`; for another family's
    config, that family's base model with random weights and its norms and biases moved off their init."""
    if hf_config_dict(name)["model_type"] != "bert":
        return _random_family_model(name, seed, attn_implementation)
    from transformers import BertConfig, BertModel

    config = BertConfig(**{k: v for k, v in hf_config_dict(name).items() if k != "model_type"},
                        attn_implementation=attn_implementation)
    model = BertModel(config, add_pooling_layer=True)
    model.load_state_dict(random_state_dict(name, seed), strict=True)
    return model.eval()


def _random_family_model(name: str, seed: int, attn_implementation: str):
    from transformers import AutoConfig, AutoModel

    fields = hf_config_dict(name)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """A right-padded batch. input_ids, attention_mask, token_type_ids: (B, S) int64."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor  # zeros when the model has no token types
    lengths: list[int]
    has_types: bool = True  # False: the model takes no token_type_ids (ModernBERT, MPNet, ...)

    @property
    def real_tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def inputs(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.has_types:
            out["token_type_ids"] = self.token_type_ids
        return out

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.attention_mask.to(device),
                     self.token_type_ids.to(device), list(self.lengths), self.has_types)


def sample_lengths(batch: int, seqlen: int, dist: str = "full", seed: int = 0) -> list[int]:
    """Real lengths of `batch` sequences padded to `seqlen`.

    dist: 'full' (all `seqlen`); 'uniform' (uniform integers in [max(1, seqlen // 4), seqlen]);
    'ragged' (uniform in [16, seqlen], the variable-length batch of the CPU and int8 targets; 'ragged<N>' uniform
    in [N, seqlen], e.g. 'ragged64', the GPU target's U[64, 512]; either taken
    stratified: the lengths at the `batch` evenly spaced quantiles of that distribution, in an order
    shuffled by `seed`. A batch of 8 independent draws has a fill (real / padded tokens) of 0.56 +- 0.09,
    and a padding-free engine's speedup over a padded one scales with 1 / fill; the stratified batch
    has the distribution's own spread of lengths and its mean fill, with no luck of the draw);
    'short' (short text such as queries and single sentences: log-normal with median 20 tokens and
    sigma 0.6, i.e. ~90% under 45 tokens, clipped to [4, seqlen]).
    """
    if batch < 1 or seqlen < 1:
        raise ValueError(f"batch and seqlen must be >= 1, got batch={batch}, seqlen={seqlen}")
    g = torch.Generator().manual_seed(seed)
    if dist == "full":
        return [seqlen] * batch
    if dist == "uniform":
        lo = max(1, seqlen // 4)
        return torch.randint(lo, seqlen + 1, (batch,), generator=g).tolist()
    ragged = re.fullmatch(r"ragged(\d*)", dist)
    if ragged:
        lo = min(int(ragged.group(1) or RAGGED_MIN), seqlen)
        if lo < 1:
            raise ValueError(f"length distribution {dist!r}: the shortest length must be >= 1")
        # Quantile (i + 1/2) / batch of the uniform distribution on the integers lo..seqlen.
        lengths = [lo + int((i + 0.5) * (seqlen - lo + 1) / batch) for i in range(batch)]
        order = torch.randperm(batch, generator=g).tolist()
        return [lengths[i] for i in order]
    if dist == "short":
        z = torch.randn(batch, generator=g)
        lengths = torch.exp(math.log(20.0) + 0.6 * z).round().long()
        return lengths.clamp(min(4, seqlen), seqlen).tolist()
    raise ValueError(f"unknown length distribution {dist!r}; known: {', '.join(LENGTH_DISTRIBUTIONS)}, ragged<N>")


def make_batch(batch: int, seqlen: int, lengths="full", *, vocab_size: int = 30522,
               type_vocab_size: int = 2, pad_token_id: int = 0, seed: int = 0) -> Batch:
    """A right-padded batch with real lengths `lengths` (a distribution name or a list of ints).

    Real tokens are random word-piece ids (>= 999 when the vocabulary is BERT-sized, which skips
    the reserved and special ids), with [CLS]=101 first and [SEP]=102 last when the vocabulary has
    them; rows of 8+ tokens carry a second segment (token type 1) over their second half.
    Padded positions hold `pad_token_id`, mask 0, token type 0.
    """
    if isinstance(lengths, str):
        lengths = sample_lengths(batch, seqlen, lengths, seed)
    lengths = [int(n) for n in lengths]
    if len(lengths) != batch or any(n < 1 or n > seqlen for n in lengths):
        raise ValueError(f"lengths must be {batch} integers in [1, {seqlen}], got {lengths}")
    g = torch.Generator().manual_seed(seed + 1)
    low = 999 if vocab_size > 2000 else 1
    ids = torch.randint(low, vocab_size, (batch, seqlen), generator=g)
    pos = torch.arange(seqlen)[None, :]
    n = torch.tensor(lengths)[:, None]
    mask = (pos < n).long()
    if vocab_size > 102:
        ids[:, 0] = 101
        ids[pos == n - 1] = 102
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_token_id))
    types = torch.zeros_like(ids)
    if type_vocab_size > 1:
        second = (pos >= n // 2) & (pos < n) & (n >= 8)
        types[second] = 1
    return Batch(ids, mask, types, lengths, type_vocab_size > 0)


_WORKLOAD_RE = re.compile(r"^b(\d+)xs(\d+)(?:-(full|uniform|ragged\d*|short))?$")


@dataclass(frozen=True)
class Workload:
    """batch x padded seqlen with a length distribution; named like 'b8xs128' or 'b8xs128-uniform'."""

    batch: int
    seqlen: int
    lengths: str = "full"

    @property
    def name(self) -> str:
        base = f"b{self.batch}xs{self.seqlen}"
        return base if self.lengths == "full" else f"{base}-{self.lengths}"

    @classmethod
    def parse(cls, text: str) -> "Workload":
        m = _WORKLOAD_RE.match(text.strip())
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(
                f"workload {text!r} is not of the form b<batch>xs<seqlen>[-{'|'.join(LENGTH_DISTRIBUTIONS)}"
                "|ragged<N>] (e.g. b8xs128, b8xs128-uniform, b32xs512-ragged64)"
            )
        return cls(int(m.group(1)), int(m.group(2)), m.group(3) or "full")

    def make_batch(self, config: ModelConfig, seed: int = 0) -> Batch:
        if self.seqlen > config.max_position_embeddings:
            raise ValueError(f"workload {self.name}: seqlen {self.seqlen} exceeds the model's "
                             f"max_position_embeddings = {config.max_position_embeddings}")
        return make_batch(self.batch, self.seqlen, self.lengths, vocab_size=config.vocab_size,
                          type_vocab_size=config.type_vocab_size, pad_token_id=config.pad_token_id,
                          seed=seed)


DEFAULT_WORKLOADS = ("b1xs16", "b1xs128", "b8xs128", "b32xs128", "b32xs512",
                     "b8xs128-uniform", "b8xs128-ragged", "b8xs128-short")
QUICK_WORKLOADS = ("b1xs16", "b8xs128", "b8xs128-ragged")


# ----------------------------------------------------------------------------------------------
# Per-op cost model (one layer): FLOPs counted as 2 per multiply-add; bytes are the compulsory
# traffic of a fused kernel (read inputs and weights once, write the output once, no intermediates).

OPS = ("qkv", "attention", "attn_out", "linear_gelu", "ffn_out", "layernorm")


def op_cost(op: str, config: ModelConfig, lengths, elem_bytes: int) -> tuple[float, float]:
    """(flops, bytes) of one call of `op` over packed tokens of sequences with `lengths`.

    op: 'qkv' (T x H -> T x 3H), 'attention' (varlen, no score matrix in memory), 'attn_out'
    (linear_residual H -> H), 'linear_gelu' (H -> I), 'ffn_out' (linear_residual I -> H),
    'layernorm' (T x H). elem_bytes: 4 for fp32, 2 for bf16/fp16.
    """
    H, I = config.hidden_size, config.intermediate_size
    T = float(sum(lengths))
    e = elem_bytes
    if op == "qkv":
        return 2 * T * H * 3 * H, e * (T * H + 3 * H * H + 3 * H + 3 * T * H)
    if op == "attention":
        sq = float(sum(n * n for n in lengths))
        # QK^T and PV: 2 * L^2 * d per head each, heads * d = H; softmax (~5 flops/score) on top.
        return 4 * sq * H + 5 * sq * config.num_attention_heads, e * 4 * T * H
    if op == "attn_out":
        return 2 * T * H * H, e * (T * H + H * H + H + 2 * T * H)
    if op == "linear_gelu":
        return 2 * T * H * I + 8 * T * I, e * (T * H + I * H + I + T * I)
    if op == "ffn_out":
        return 2 * T * I * H, e * (T * I + H * I + H + 2 * T * H)
    if op == "layernorm":
        return 8 * T * H, e * (2 * T * H + 2 * H)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def layer_inputs(op: str, weights: ModelWeights, lengths, seed: int = 0):
    """Positional arguments of backend op `op` for one layer of `weights` over packed `lengths`.

    Activations are random in the weights' dtype and device (LayerNorm input offset from zero, as
    after a residual add). `weights` should already be `backend.prepare`d when the op expects
    packed forms. Returns a tuple to splat into `getattr(backend, OP_FUNCTION[op])` ('attn_out',
    'linear_gelu' and 'ffn_out' all call the backend's `linear`).
    """
    cfg, layer = weights.config, weights.layers[0]
    dt, dev = weights.dtype, weights.device
    g = torch.Generator().manual_seed(seed)
    T, H, I = int(sum(lengths)), cfg.hidden_size, cfg.intermediate_size
    heads, d = cfg.num_attention_heads, cfg.head_dim

    def act(*shape, offset=0.0):
        return (torch.randn(*shape, generator=g) + offset).to(dtype=dt, device=dev)

    if op == "qkv":
        return act(T, H), layer.qkv_weight, layer.qkv_bias, heads
    if op == "attention":
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        q, k, v = act(T, heads, d), act(T, heads, d), act(T, heads, d)
        return q, k, v, cu.to(dev), int(max(lengths)), 1.0 / math.sqrt(d)
    if op == "attn_out":
        return act(T, H), layer.attn_out_weight, layer.attn_out_bias, "none", act(T, H)
    if op == "linear_gelu":
        return act(T, H), layer.ffn_in_weight, layer.ffn_in_bias, cfg.activation
    if op == "ffn_out":
        return act(T, I), layer.ffn_out_weight, layer.ffn_out_bias, "none", act(T, H)
    if op == "layernorm":
        return act(T, H, offset=3.0), layer.attn_ln_weight, layer.attn_ln_bias, cfg.layer_norm_eps
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


OP_FUNCTION = {"qkv": "qkv", "attention": "attention", "attn_out": "linear", "linear_gelu": "linear",
               "ffn_out": "linear", "layernorm": "layernorm"}


__all__ = [
    "CONFIGS", "LENGTH_DISTRIBUTIONS", "DEFAULT_WORKLOADS", "QUICK_WORKLOADS", "OPS", "OP_FUNCTION",
    "Batch", "Workload", "hf_config_dict", "model_config", "random_state_dict", "random_weights",
    "random_hf_model", "sample_lengths", "make_batch", "op_cost", "layer_inputs",
]
