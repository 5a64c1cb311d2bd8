"""Random-weight transformers models of the rotary families (ModernBERT, NomicBERT, GTE) for the tests.

Each builder moves every norm weight and bias off its init (LayerNorm at identity and zero biases would hide
mistakes); the named configs cover each family's variants: ModernBERT with and without biases, a sliding window
smaller than the test rows and one larger; GTE with and without token types.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 97

CONFIGS = {
    # ModernBERT: pre-LN, GeGLU, global layer every 3rd (0, 3), local window local_attention // 2
    "modernbert": ("ModernBert", dict(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                      num_hidden_layers=4, local_attention=16)),
    "modernbert-bias": ("ModernBert", dict(hidden_size=96, num_attention_heads=3, intermediate_size=80,
                                           num_hidden_layers=3, local_attention=10, global_attn_every_n_layers=2,
                                           attention_bias=True, mlp_bias=True, norm_bias=True,
                                           hidden_activation="gelu_pytorch_tanh", global_rope_theta=5000.0,
                                           local_rope_theta=500.0)),
    # NomicBERT: post-LN, SwiGLU, no linear biases
    "nomic_bert": ("NomicBert", dict(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                     num_hidden_layers=2, layer_norm_eps=1e-5)),
    # GTE: post-LN, GeGLU, biases on attention and FFN out, one token type (or none)
    "gte": ("Gte", dict(hidden_size=64, num_attention_heads=2, intermediate_size=112, num_hidden_layers=2)),
    "gte-notypes": ("Gte", dict(hidden_size=80, num_attention_heads=5, intermediate_size=96, num_hidden_layers=2,
                                type_vocab_size=0, hidden_act="silu")),
}
FAMILY_OF = {name: name.split("-")[0] for name in CONFIGS}


def require_reference(name: str, *classes: str) -> None:
    """Skips, naming them, where the installed transformers lacks the reference's classes (5.17 has no Gte*)."""
    import transformers
    missing = [n for n in classes if not hasattr(transformers, n)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)} (the reference for {name})")


def build(name: str, task: str = "Model", seed: int = 0, attn: str = "eager", **overrides):
    """transformers' `<Family><task>` for config `name` of CONFIGS, random weights, fp32, eval."""
    import transformers
    prefix, kw = CONFIGS[name]
    kw = {**kw, "vocab_size": VOCAB, **overrides}
    if prefix == "ModernBert":  # its default special ids lie past a small vocabulary
        kw = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1, "sep_token_id": 2, **kw}
    require_reference(name, prefix + "Config", prefix + task)
    config = getattr(transformers, prefix + "Config")(**kw, attn_implementation=attn)
    torch.manual_seed(seed)
    model = getattr(transformers, prefix + task)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname.lower() or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def batch(lengths, seed=1, layout="right", types=0):
    """ids, mask (B, S) with pad id 0 at padded positions; layout "left" pads on the left. types > 0: also
    random token type ids below `types`."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    if layout == "left":
        mask = mask.flip(1)
    ids = torch.randint(3, VOCAB, (len(lengths), S), generator=g) * mask
    if types:
        return ids, mask, torch.randint(0, types, ids.shape, generator=g) * mask
    return ids, mask
