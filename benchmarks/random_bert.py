"""What the bench scripts of the other output kinds (bench_splade.py, bench_colbert.py) wrap in each library's format:
a random BERT saved with the embedded model's tokenizer files."""

from __future__ import annotations

import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def save_random_bert(path: str, hidden: int, layers: int, head: str = "none") -> str:
    """A BERT of `hidden` x `layers` (BERT's 30522-token vocabulary, hidden / 64 heads, FFN 4 x hidden), random
    weights of seed 0, saved at `path` with all-MiniLM-L6-v2's tokenizer (the same vocabulary). head: "none"
    (BertModel, no pooler) or "mlm" (BertForMaskedLM). Returns `path`."""
    import torch
    import transformers

    import bertfast

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden)
    model = transformers.BertForMaskedLM(cfg) if head == "mlm" else transformers.BertModel(cfg, add_pooling_layer=False)
    model.eval().save_pretrained(path)
    tokenizer_dir = bertfast.default_model_path()
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path
