"""Random transformers task models of the encoder families with heads (tests/test_heads.py,
tests/test_adapters_heads.py)."""

import torch
import transformers

from helpers.families import COMMON, NO_TYPES

PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "electra": "Electra",
          "albert": "Albert", "distilbert": "DistilBert", "mpnet": "MPNet", "deberta-v2": "DebertaV2"}


def config(family, **kw):
    """Small configs whose hidden_act differs from the activations some heads fix (RoBERTa lm_head
    and ELECTRA classifier: gelu; DistilBERT pre_classifier: relu), so a mix-up shows."""
    kw.setdefault("num_labels", 3)
    if family == "bert":
        return transformers.BertConfig(**COMMON, **kw)
    if family == "roberta":
        return transformers.RobertaConfig(**{**COMMON, "type_vocab_size": 1, "hidden_act": "relu"}, pad_token_id=1,
                                          **kw)
    if family == "xlm-roberta":
        return transformers.XLMRobertaConfig(**{**COMMON, "type_vocab_size": 1, "hidden_act": "gelu_new"},
                                             pad_token_id=1, **kw)
    if family == "electra":
        return transformers.ElectraConfig(**{**COMMON, "hidden_act": "relu"}, embedding_size=32, **kw)
    if family == "albert":
        return transformers.AlbertConfig(**{**COMMON, "num_hidden_layers": 3}, embedding_size=16,
                                         num_hidden_groups=2, **kw)
    if family == "mpnet":
        return transformers.MPNetConfig(**{**NO_TYPES, "hidden_act": "relu"}, **kw)
    if family == "deberta-v2":  # v3 style; the pooler's gelu differs from the layers' relu
        return transformers.DebertaV2Config(**{**NO_TYPES, "hidden_act": "relu"}, relative_attention=True,
                                            pos_att_type="p2c|c2p", share_att_key=True, position_buckets=8,
                                            norm_rel_ebd="layer_norm", position_biased_input=False, **kw)
    return transformers.DistilBertConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, hidden_dim=96,
                                         max_position_embeddings=40, activation="gelu_new", **kw)


def build(family, task, seed=0, **kw):
    """transformers' `<Family>For<task>` on `config`, random weights with LayerNorms and biases perturbed, eval."""
    if task == "QuestionAnswering":
        kw.setdefault("num_labels", 2)
    torch.manual_seed(seed)
    model = getattr(transformers, PREFIX[family] + "For" + task)(config(family, **kw)).eval()
    with torch.no_grad():  # random init leaves LayerNorms at identity and biases at zero
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model
