"""Random SPLADE checkpoints saved the way sentence-transformers saves a `SparseEncoder` (modules.json, the
*ForMaskedLM weights, SpladePooling's config), with the default model's tokenizer: nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import warnings

import torch

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def mlm_model(seed: int = 0, **overrides):
    """A random BertForMaskedLM (fp32, eval) with LayerNorms and biases perturbed off their init (so they are
    tested), the decoder bias included."""
    import transformers

    cfg = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
               max_position_embeddings=64, type_vocab_size=2, hidden_act="gelu")
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_splade(path, tokenizer_dir: str, *, pooling: str = "max", activation: str = "relu",
                max_active_dims: int | None = None, seed: int = 0, **overrides) -> str:
    """A SparseEncoder directory at `path` (Transformer fill-mask + SpladePooling), as sentence-transformers saves
    it; returns the path."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    try:
        from sentence_transformers.base.modules import Transformer
    except ImportError:  # releases before 6.0
        from sentence_transformers.models import Transformer

    path = os.fspath(path)
    mlm_dir = path + "-mlm"
    mlm_model(seed, **overrides).save_pretrained(mlm_dir)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), mlm_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        modules = [Transformer(mlm_dir, transformer_task="fill-mask"), SpladePooling(pooling, activation)]
        SparseEncoder(modules=modules, device="cpu", max_active_dims=max_active_dims).save(path)
    shutil.rmtree(mlm_dir)
    return path
