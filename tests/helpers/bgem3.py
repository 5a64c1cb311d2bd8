"""Random BGE-M3 checkpoints laid out as FlagEmbedding saves one (its M3 model's `save`: the XLM-R model's
`save_pretrained`, `colbert_linear.pt` and `sparse_linear.pt` state dicts, the tokenizer's `save_pretrained`), and
FlagEmbedding's `BGEM3FlagModel` where it imports.

No XLM-R tokenizer can be downloaded, so `save_bgem3` builds a small SentencePiece-style Unigram vocabulary of a few
words and saves it through transformers' `XLMRobertaTokenizer`: the same special tokens and ids (<s> 0, <pad> 1,
</s> 2, <unk> 3, <mask> last), the same Metaspace pre-tokenizer and `<s> $A </s>` template as the real one.
Characters it never saw (CJK, emoji) become <unk>, which BGE-M3's sparse weights drop.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
import warnings

import torch

TRAIN_WORDS = ("the a of cat dog model engine runs fast slow embedding vector sentence token padding batch "
               "Paris Zürich naïve café 42 3.14 (see below) don't e-mail well-known GPU CPU attention layer "
               "norm quickly jumps over lazy river bank money interest rates").split()


def xlmr_tokenizer(model_max_length: int = 128):
    """An `XLMRobertaTokenizer` over a small SentencePiece-style Unigram vocabulary: the special tokens, each of
    TRAIN_WORDS as a piece ("▁word") and each of their characters alone and after "▁" (other words split into
    characters, unseen characters are <unk>)."""
    from transformers import XLMRobertaTokenizer

    words = sorted(set(TRAIN_WORDS))
    chars = sorted(set("".join(words)))
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -9.0)]
    pieces += [("▁" + w, -6.0 - 0.01 * i) for i, w in enumerate(words)]
    pieces += [(c, -10.0 - 0.01 * i) for i, c in enumerate(chars)] + [("▁" + c, -10.5) for c in chars]
    return XLMRobertaTokenizer(vocab=pieces + [("<mask>", 0.0)], model_max_length=model_max_length)


def save_bgem3(path, *, hidden: int = 64, layers: int = 2, heads: int = 4, colbert_dim: int | None = None,
               max_positions: int = 130, seed: int = 0, heads_files: bool = True) -> str:
    """A random BGE-M3 directory at `path` (XLMRobertaModel, its tokenizer, colbert_linear.pt, sparse_linear.pt);
    LayerNorms and biases moved off their init so they are tested. colbert_dim None: the hidden size (BGE-M3's).
    Returns the path."""
    import transformers

    path = os.fspath(path)
    tokenizer = xlmr_tokenizer(model_max_length=max_positions - 2)
    cfg = transformers.XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                                        num_attention_heads=heads, intermediate_size=2 * hidden,
                                        max_position_embeddings=max_positions, type_vocab_size=1, pad_token_id=1,
                                        bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.XLMRobertaModel(cfg).eval()
    colbert = torch.nn.Linear(hidden, colbert_dim or hidden)
    sparse = torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        sparse.bias.fill_(0.05)  # about half the tokens get a positive weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    if heads_files:
        torch.save(colbert.state_dict(), os.path.join(path, "colbert_linear.pt"))
        torch.save(sparse.state_dict(), os.path.join(path, "sparse_linear.pt"))
    return path


@functools.cache
def flag_embedding_m3():
    """FlagEmbedding's `BGEM3FlagModel` (M3Embedder), or the reason it cannot be imported.

    FlagEmbedding's package __init__ imports every model it has, and its MiniCPM reranker imports
    `transformers.modeling_attn_mask_utils`, which transformers 5 removed; the M3 embedder itself does not need
    it, so the packages above it are entered without their __init__ (their modules load as they are)."""
    spec = importlib.util.find_spec("FlagEmbedding")
    if spec is None:
        return None, "FlagEmbedding is not installed (pip install FlagEmbedding)"
    try:
        return importlib.import_module("FlagEmbedding").BGEM3FlagModel, None
    except Exception:  # noqa: BLE001 - any import failure: try the module alone below
        for name in [n for n in sys.modules if n == "FlagEmbedding" or n.startswith("FlagEmbedding.")]:
            del sys.modules[name]
    root = spec.submodule_search_locations[0]
    for name in ("FlagEmbedding", "FlagEmbedding.inference", "FlagEmbedding.inference.embedder"):
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[name] = package
    try:
        return importlib.import_module("FlagEmbedding.inference.embedder.encoder_only.m3").M3Embedder, None
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        return None, f"FlagEmbedding's M3 embedder does not import here: {type(e).__name__}: {e}"


def reference_m3(path: str, texts: list[str], max_length: int, dtype=torch.float32):
    """FlagEmbedding's BGE-M3 computation reproduced from its source (FlagEmbedding 1.4.2: the M3 model's
    `_dense_embedding` (cls), `_sparse_embedding` (token weights), `_colbert_embedding` and forward's normalize;
    M3Embedder's `_process_token_weights` and `_process_colbert_vecs`) on transformers' XLMRobertaModel in `dtype`,
    the heads in fp32 (as bertfast runs them). Texts one at a time (no padding). Returns encode's dict."""
    from collections import defaultdict

    import numpy as np
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=dtype).eval()
    heads = {}
    for name in ("colbert", "sparse"):
        state = torch.load(os.path.join(path, f"{name}_linear.pt"), weights_only=True)
        heads[name] = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
        heads[name].load_state_dict(state)
    unused = {tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map[t])
              for t in ("cls_token", "eos_token", "pad_token", "unk_token") if t in tokenizer.special_tokens_map}
    dense, lexical, colbert = [], [], []
    with torch.no_grad():
        for text in texts:
            inputs = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
            last = model(**inputs, return_dict=True).last_hidden_state.float()
            dense.append(F.normalize(last[:, 0], dim=-1)[0].numpy())
            weights = torch.relu(heads["sparse"](last)).squeeze(-1)[0].numpy()
            result = defaultdict(int)
            for w, idx in zip(weights, inputs["input_ids"][0].tolist()):
                if idx not in unused and w > 0 and w > result[str(idx)]:
                    result[str(idx)] = w
            lexical.append(result)
            colbert.append(F.normalize(heads["colbert"](last[:, 1:]), dim=-1)[0].numpy())
    return {"dense_vecs": np.stack(dense), "lexical_weights": lexical, "colbert_vecs": colbert}
