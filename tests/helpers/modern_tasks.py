"""Random-weight transformers task models of the rotary families (ModernBERT, NomicBERT, GTE) for the head,
optimize and encode tests, and ragged batches for them.

Small configs (hidden 64, 3 layers; ModernBERT with a sliding window of 8 tokens every other layer); each builder
moves every norm weight and bias off its init; LENGTHS holds a 1-token row and rows longer than the window.
"""

from __future__ import annotations

import torch
import transformers

import bertfast
from helpers.families import batch_for
from modern_models import require_reference


BACKENDS = ["torch"] + (["cpu"] if bertfast.backends.available_backends("cpu").get("cpu") is None else [])
PREFIX = {"modernbert": "ModernBert", "nomic_bert": "NomicBert", "gte": "Gte"}
SMALL = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
             pad_token_id=0)
LENGTHS = [20, 1, 9, 13, 5, 17]  # ModernBERT's window: 8 tokens


def config(family, **kw):
    """transformers' config of `family`: SMALL, 3 labels, the family's own special ids; `kw` overrides."""
    kw = {**SMALL, "num_labels": 3, **kw}
    if family == "modernbert":
        return transformers.ModernBertConfig(**{"local_attention": 8, "global_attn_every_n_layers": 2,
                                                "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1,
                                                "sep_token_id": 2, **kw})
    if family == "nomic_bert":  # hidden_act silu (SwiGLU): also the MLM head's activation
        return transformers.NomicBertConfig(**kw)
    # the GTE MLM head's gelu is fixed, not the layers' activation: make them differ
    return transformers.GteConfig(**{"hidden_act": "silu", **kw})


def build(family, cls_name, seed=0, **kw):
    """transformers' `cls_name` (e.g. "GteForMaskedLM") on `config(family, **kw)`, random weights, fp32, eval."""
    require_reference(family, PREFIX[family] + "Config", cls_name)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config(family, **kw)).eval()
    with torch.no_grad():  # random init leaves norms at identity and biases at zero
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs_for(model, multiple_choice=False, lengths=LENGTHS):
    """Ragged right-padded batch; multiple choice: 3 questions x 2 choices."""
    kwargs, mask = batch_for(model, lengths, seed=4)
    if multiple_choice:
        kwargs = {k: v.view(3, 2, -1) for k, v in kwargs.items()}
    return kwargs, mask
