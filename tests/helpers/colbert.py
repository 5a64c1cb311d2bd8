"""Random ColBERT checkpoints in PyLate's format, and an oracle of its rules, for tests/test_colbert.py.

`save_with_pylate` has PyLate build and save one (from a random BertModel and the default model's tokenizer), in
PyLate's child process (tests/helpers/pylate_side.py); `write_colbert` writes the same files without PyLate (the
prefix tokens added to the tokenizer, the embeddings grown to match, modules.json, the Dense projection,
config_sentence_transformers.json); `oracle` applies PyLate's rules to one text at a time with transformers'
tokenizer and model: nothing is downloaded.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import string
import warnings

import numpy as np
import torch

from helpers.splade import TOKENIZER_FILES

BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
            max_position_embeddings=256, type_vocab_size=2, hidden_act="gelu")
# ModernBERT with the BERT tokenizer's special ids; a local window (64: 32 each side) that holds a whole query, as
# real checkpoints' 128 does (a [MASK] with no key inside its window is degenerate in transformers and here alike)
MODERNBERT = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                  max_position_embeddings=256, local_attention=64, global_attn_every_n_layers=2, pad_token_id=0,
                  cls_token_id=101, sep_token_id=102, bos_token_id=101, eos_token_id=102)
DEFAULTS = dict(query_prefix="[Q] ", document_prefix="[D] ", query_length=32, document_length=180,
                do_query_expansion=True, attend_to_expansion_tokens=False, skiplist_words=list(string.punctuation))


def base_model(path, tokenizer_dir: str, seed: int = 0, vocab_size: int = 30522, family: str = "bert"):
    """A random BertModel or ModernBertModel (norms and biases moved off their init) saved at `path` with the
    default tokenizer."""
    import transformers

    torch.manual_seed(seed)
    if family == "modernbert":
        model = transformers.ModernBertModel(transformers.ModernBertConfig(vocab_size=vocab_size, **MODERNBERT))
    else:
        model = transformers.BertModel(transformers.BertConfig(vocab_size=vocab_size, **BERT), add_pooling_layer=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def save_with_pylate(path, tokenizer_dir: str, *, seed: int = 0, embedding_size: int = 32, family: str = "bert",
                     **colbert) -> str:
    """PyLate's ColBERT over a random `base_model`, saved by PyLate at `path` (colbert: its constructor's ColBERT
    arguments, e.g. query_length, attend_to_expansion_tokens)."""
    from pylate import models

    path = os.fspath(path)
    base_model(path + "-base", tokenizer_dir, seed, family=family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models.ColBERT(path + "-base", device="cpu", embedding_size=embedding_size, **colbert).save(path)
    shutil.rmtree(path + "-base")
    return path


def write_colbert(path, tokenizer_dir: str, *, seed: int = 0, embedding_size: int = 32, dense_bias: bool = False,
                  family: str = "bert", **colbert) -> str:
    """The files PyLate writes, written here: the prefix tokens added to the tokenizer (as PyLate's add_tokens),
    the word embeddings grown to the tokenizer, a Dense projection (bias optional), the ColBERT settings."""
    import transformers
    from safetensors.torch import save_file

    path = os.fspath(path)
    settings = {**DEFAULTS, **colbert}
    os.makedirs(path, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_tokens([p for p in (settings["query_prefix"], settings["document_prefix"]) if p])
    tok.save_pretrained(path)
    base_model(path, tokenizer_dir, seed, vocab_size=len(tok), family=family)
    tok.save_pretrained(path)  # base_model copied the original tokenizer files back
    g = torch.Generator().manual_seed(seed + 1)
    os.makedirs(os.path.join(path, "1_Dense"))
    weights = {"linear.weight": torch.randn(embedding_size, BERT["hidden_size"], generator=g) * 0.2}
    if dense_bias:
        weights["linear.bias"] = torch.randn(embedding_size, generator=g) * 0.1
    save_file(weights, os.path.join(path, "1_Dense", "model.safetensors"))
    files = {
        "1_Dense/config.json": dict(in_features=BERT["hidden_size"], out_features=embedding_size, bias=dense_bias,
                                    activation_function="torch.nn.modules.linear.Identity", use_residual=False),
        "modules.json": [dict(idx=0, name="0", path="", type="sentence_transformers.models.Transformer"),
                         dict(idx=1, name="1", path="1_Dense", type="pylate.models.Dense.Dense")],
        "sentence_bert_config.json": dict(max_seq_length=512, do_lower_case=False),
        "config_sentence_transformers.json": dict(model_type="ColBERT", prompts={"query": "", "document": ""},
                                                  default_prompt_name=None, similarity_fn_name="MaxSim", **settings),
    }
    for name, content in files.items():
        with open(os.path.join(path, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
    return path


def oracle(path, texts, is_query: bool) -> list[np.ndarray]:
    """PyLate's encode rules applied one text at a time with transformers (fp32): strip, truncate to the length less
    the prefix, the prefix id after [CLS], queries padded to query_length with [MASK] (attended to or not), the
    Dense projection, documents' skiplist tokens dropped, each vector L2-normalised."""
    import transformers
    from safetensors.torch import load_file

    with open(os.path.join(path, "config_sentence_transformers.json"), encoding="utf-8") as f:
        c = {**DEFAULTS, **json.load(f)}
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    dense = load_file(os.path.join(path, "1_Dense", "model.safetensors"))
    length, prefix = (c["query_length"], c["query_prefix"]) if is_query else (c["document_length"],
                                                                              c["document_prefix"])
    expand = is_query and c["do_query_expansion"]
    skip = set(tok.convert_tokens_to_ids(c["skiplist_words"]))
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters
    out = []
    for text in texts:
        ids = tok(text.strip(), truncation=True, max_length=length - bool(prefix))["input_ids"]
        if prefix:
            ids = ids[:1] + [tok.convert_tokens_to_ids(prefix)] + ids[1:]
        mask = [1] * len(ids)
        if expand:
            pad = length - len(ids)
            ids, mask = ids + [tok.mask_token_id] * pad, mask + [int(c["attend_to_expansion_tokens"])] * pad
        with torch.no_grad():
            types = {"token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)} if takes_types else {}
            states = model(input_ids=torch.tensor([ids]), attention_mask=torch.tensor([mask]),
                           **types).last_hidden_state[0]
        keep = [True] * len(ids) if is_query else [i not in skip for i in ids]
        x = torch.nn.functional.linear(states[torch.tensor(keep)], dense["linear.weight"], dense.get("linear.bias"))
        out.append(torch.nn.functional.normalize(x, p=2, dim=1).numpy())
    return out
