"""Random-weight transformers models of the BERT-style families (BERT, RoBERTa, XLM-R, ELECTRA, ALBERT,
DistilBERT, MPNet) and ragged batches for them.

Each builder moves every norm weight and bias off its init (LayerNorm at identity and zero biases would hide
mistakes); `batch_for` keeps every row within the model's position limit and its ids off the pad id.
"""

from __future__ import annotations

import torch
import transformers

import bertfast
from conftest import ragged_batch


CPU_BACKENDS = [n for n, r in bertfast.available_backends("cpu").items() if r is None and n != "triton"]
COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              max_position_embeddings=40, type_vocab_size=2, layer_norm_eps=1e-12)
NO_TYPES = {k: v for k, v in COMMON.items() if k != "type_vocab_size"}  # MPNet has no token types

FAMILIES = {
    "bert": lambda: transformers.BertModel(transformers.BertConfig(**COMMON)),
    "roberta": lambda: transformers.RobertaModel(transformers.RobertaConfig(**{**COMMON, "type_vocab_size": 1},
                                                                            pad_token_id=1)),
    "xlm-roberta": lambda: transformers.XLMRobertaModel(transformers.XLMRobertaConfig(
        **{**COMMON, "type_vocab_size": 1, "hidden_act": "gelu_new"}, pad_token_id=1)),
    "electra": lambda: transformers.ElectraModel(transformers.ElectraConfig(**COMMON, embedding_size=32)),
    "electra-same-size": lambda: transformers.ElectraModel(transformers.ElectraConfig(**COMMON, embedding_size=64)),
    "albert": lambda: transformers.AlbertModel(transformers.AlbertConfig(
        **{**COMMON, "num_hidden_layers": 3}, embedding_size=16, num_hidden_groups=2, inner_group_num=1)),
    "albert-inner2": lambda: transformers.AlbertModel(transformers.AlbertConfig(
        **COMMON, embedding_size=16, num_hidden_groups=1, inner_group_num=2, hidden_act="relu")),
    "distilbert": lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=97, dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=40)),
    "distilbert-sinusoidal": lambda: transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=97, dim=64, n_layers=1, n_heads=2, hidden_dim=96, max_position_embeddings=40,
        sinusoidal_pos_embds=True)),
    "mpnet": lambda: transformers.MPNetModel(transformers.MPNetConfig(**NO_TYPES, hidden_act="gelu_new")),
}


def build(name, seed=0):
    """transformers' base model for family config `name` of FAMILIES, random weights, fp32, eval."""
    torch.manual_seed(seed)
    model = FAMILIES[name]().eval()
    with torch.no_grad():  # random init leaves LayerNorms at identity and biases at zero
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch_for(model, lengths, seed=1):
    """(kwargs, mask): a right-padded batch for `model` (token types only where it has them), lengths capped at
    its position limit."""
    cfg = model.config
    pad = cfg.pad_token_id or 0
    limit = cfg.max_position_embeddings - (pad + 1 if cfg.model_type in ("roberta", "xlm-roberta", "mpnet") else 0)
    lengths = [min(n, limit) for n in lengths]
    ids, mask, types = ragged_batch(lengths, vocab=cfg.vocab_size, seed=seed)
    ids = torch.where(mask.bool(), ids.clamp_min(pad + 1), torch.full_like(ids, pad))
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if getattr(cfg, "type_vocab_size", 0) > 1:
        kwargs["token_type_ids"] = types
    return kwargs, mask
