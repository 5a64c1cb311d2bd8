"""Late interaction: `ColBERT`, PyLate's `models.ColBERT.encode` on the bertfast engine (MaxSim: `maxsim`).

A PyLate checkpoint is a sentence-transformers directory: modules.json lists the Transformer (in the directory itself)
then Dense projections applied to every token; config_sentence_transformers.json holds the ColBERT rules, PyLate's
defaults where it is silent: query_prefix / document_prefix ("[Q] ", "[D] ": a token inserted after the first, [CLS]),
query_length / document_length (32, 180: the most tokens, the prefix included), do_query_expansion (True: queries
padded to query_length with [MASK], every position kept), attend_to_expansion_tokens (False: no token attends to
those [MASK]s, which the engine computes all the same under a key mask, `engine.key_bias`) and skiplist_words (the
document tokens left out of the output: punctuation). Each text gets (tokens, dim) L2-normalised vectors, as PyLate's
encode returns them. A text's vectors do not depend on its batch (cpu backend: bit for bit): the projection and the
normalisation are per token, on the backend's batch-invariant GEMM.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError
from .encoder import Encoder
from .head_linear import HeadLinear
from .sentence import Dense, read_dense, read_json, resolve_prompt
from .workers import ordered_map, plan

# The tokenizer's special tokens the rules read: the query padding (the first present) and [UNK].
SPECIAL_TOKENS = ("mask_token", "eos_token", "pad_token", "unk_token")
# Dense activations (class names in a saved config) -> the backend's epilogue ids.
_DENSE_ACTIVATIONS = {"Identity": "none", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu", "SiLU": "silu"}


@dataclass
class ColBERTConfig:
    """PyLate's ColBERT settings (its defaults where the checkpoint says nothing)."""

    query_prefix: str = "[Q] "
    document_prefix: str = "[D] "
    query_length: int = 32
    document_length: int = 180
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: list = field(default_factory=lambda: list(string.punctuation))
    prompts: dict = field(default_factory=lambda: {"query": "", "document": ""})
    default_prompt_name: str | None = None

    def __post_init__(self):
        for name in ("query_prefix", "document_prefix"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"ColBERT: {name} must be a string, got {getattr(self, name)!r}")
        for name, prefix in (("query_length", self.query_prefix), ("document_length", self.document_prefix)):
            value, least = getattr(self, name), 3 if prefix else 2  # [CLS] (prefix) [SEP]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"ColBERT: {name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.skiplist_words, list) or not all(isinstance(w, str) for w in self.skiplist_words):
            raise ConfigError(f"ColBERT: skiplist_words must be a list of strings, got {self.skiplist_words!r}")
        if not isinstance(self.prompts, dict) or not all(isinstance(v, str) for v in self.prompts.values()):
            raise ConfigError(f"ColBERT: 'prompts' must map names to strings, got {self.prompts!r}")
        self.do_query_expansion = bool(self.do_query_expansion)
        # PyLate: without query expansion there are no expansion tokens to attend to
        self.attend_to_expansion_tokens = bool(self.attend_to_expansion_tokens) and self.do_query_expansion


def _is_pylate_stack(modules: list) -> bool:
    """Whether sorted modules.json entries are PyLate's stack: a Transformer in the directory itself, then Dense
    projections only (a sentence-transformers embedding model has a Pooling module; PyLate's never does)."""
    kinds = [str(m["type"]).rpartition(".")[2] for m in modules]
    return (len(kinds) >= 2 and kinds[0] == "Transformer" and all(k == "Dense" for k in kinds[1:])
            and os.path.normpath(modules[0].get("path") or ".") == ".")


def is_colbert_checkpoint(directory: str) -> bool:
    """Whether `directory` is a PyLate ColBERT: its modules.json lists PyLate's stack (`read_colbert_config`'s rule)."""
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return False
    modules = read_json(path, "ColBERT")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        return False
    return _is_pylate_stack(sorted(modules, key=lambda m: m.get("idx", 0)))


def read_colbert_config(directory: str) -> tuple[ColBERTConfig, list]:
    """The ColBERT settings and the Dense projections (`sentence.Dense`, in order) of a PyLate directory; ConfigError
    names a module stack PyLate would not load as it is (no Dense: PyLate adds a random one)."""
    modules = read_json(os.path.join(directory, "modules.json"), "ColBERT")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ConfigError("modules.json must be a list of {idx, name, path, type} objects")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    if not _is_pylate_stack(modules):
        raise ConfigError(f"modules.json: a PyLate ColBERT is a Transformer in the model's own directory followed by "
                          f"Dense projections; found {[m['type'] for m in modules]}")
    dense = [read_dense(os.path.join(directory, m.get("path") or ""), f"modules.json module {i} ({m['type']})")
             for i, m in enumerate(modules) if i]
    st = read_json(os.path.join(directory, "config_sentence_transformers.json"), "ColBERT", False)
    keys = ("query_prefix", "document_prefix", "query_length", "document_length", "do_query_expansion",
            "attend_to_expansion_tokens", "skiplist_words", "default_prompt_name")
    config = ColBERTConfig(**{k: st[k] for k in keys if st.get(k) is not None},
                           prompts={"query": "", "document": "", **(st.get("prompts") or {})})
    return config, dense


def _special_token(directory: str, name: str) -> str | None:
    """A special token's text from tokenizer_config.json or special_tokens_map.json (None: neither names it)."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(directory, file), encoding="utf-8") as f:
                value = json.load(f).get(name)
        except (OSError, json.JSONDecodeError):
            continue
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            return value
    return None


class ColBERT(nn.Module):
    """ColBERT on bertfast: `encode(texts, is_query=...)` -> per text a (tokens, dim) float32 array of L2-normalised
    token vectors, as PyLate's `models.ColBERT.encode`. Build it with `from_pretrained(dir)`."""

    def __init__(self, encoder: Encoder, config: ColBERTConfig, dense: list, special: dict):
        """encoder: with its tokenizer; dense: `sentence.Dense` projections in order; special: the tokenizer's
        "mask_token", "eos_token", "pad_token" and "unk_token" texts (None where it has none)."""
        super().__init__()
        from tokenizers import Tokenizer

        self.encoder, self.colbert = encoder, config
        self.backend = encoder.engine.backend
        limit = encoder.config.max_position_embeddings
        for name in ("query_length", "document_length"):
            if getattr(config, name) > limit:
                raise ConfigError(f"ColBERT: {name} {getattr(config, name)} exceeds the model's {limit} positions")
        base = encoder.tokenizer
        ids = {}
        for name in ("query_prefix", "document_prefix"):
            prefix = getattr(config, name)
            ids[name] = None if not prefix else base.token_to_id(prefix)
            if prefix and ids[name] is None:
                raise ConfigError(f"ColBERT: the tokenizer has no token {prefix!r} ({name}); PyLate would add one "
                                  "with a new, untrained embedding")
        self.query_prefix_id, self.document_prefix_id = ids["query_prefix"], ids["document_prefix"]
        self.pad_id = None
        for name in ("mask_token", "eos_token", "pad_token"):  # PyLate pads with [MASK], else </s>, else the pad
            token = special.get(name)
            self.pad_id = None if token is None else base.token_to_id(token)
            if self.pad_id is not None:
                break
        if self.pad_id is None:
            raise ConfigError("ColBERT: the tokenizer has no mask, eos or pad token to pad queries with")
        unk = special.get("unk_token")
        unk_id = None if unk is None else base.token_to_id(unk)
        # as transformers' convert_tokens_to_ids: a word outside the vocabulary stands for the unknown token
        skip = (base.token_to_id(w) for w in config.skiplist_words)
        self.skiplist = sorted({unk_id if i is None else i for i in skip} - {None})
        self._tokenizers = {}
        for is_query, length, prefix_id in ((True, config.query_length, self.query_prefix_id),
                                            (False, config.document_length, self.document_prefix_id)):
            tok = Tokenizer.from_str(base.to_str())
            tok.no_padding()
            tok.enable_truncation(max_length=length - (prefix_id is not None))
            self._tokenizers[is_query] = tok
        self.dense = []  # (HeadLinear, act, residual: None | "input" | HeadLinear projection)
        for d in dense:
            if d.activation not in _DENSE_ACTIVATIONS:
                raise ConfigError(f"ColBERT: a Dense activation {d.activation!r} is not supported "
                                  f"({', '.join(_DENSE_ACTIVATIONS)})")
            residual = None
            if d.use_residual:
                residual = "input" if d.residual is None else HeadLinear(encoder, d.residual)
            self.dense.append((HeadLinear(encoder, d.weight, d.bias), _DENSE_ACTIVATIONS[d.activation], residual))
        self.dim = dense[-1].weight.shape[0]

    @classmethod
    def from_pretrained(cls, path, *, backend: str = "auto", dtype=None):
        """A PyLate ColBERT directory (modules.json: Transformer then Dense; config_sentence_transformers.json's
        ColBERT keys; the tokenizer with the prefix tokens). backend and dtype as `Encoder.from_pretrained`
        (None, "auto", torch.bfloat16, "int8"): the encoder's; the projection runs as `HeadLinear` (bf16 under a bf16
        engine on the cpu backend, else fp32)."""
        path = os.fspath(path)
        config, dense = read_colbert_config(path)
        special = {name: _special_token(path, name) for name in SPECIAL_TOKENS}
        encoder = Encoder.from_pretrained(path, backend=backend, dtype=dtype, add_pooling_layer=False)
        return cls(encoder, config, dense, special)

    @classmethod
    def from_pylate(cls, model, *, backend: str = "auto", dtype=None):
        """An in-memory `pylate.models.ColBERT`: its encoder's weights, tokenizer, Dense modules and ColBERT
        settings (backend and dtype as `from_pretrained`)."""
        from tokenizers import Tokenizer

        modules = list(model)
        hf = getattr(modules[0], "auto_model", None) if modules else None
        if hf is None or len(modules) < 2 or any(type(m).__name__ != "Dense" for m in modules[1:]):
            raise ConfigError(f"a PyLate ColBERT is a Transformer followed by Dense projections; this model has "
                              f"{[type(m).__name__ for m in modules]}")
        if getattr(modules[0], "do_lower_case", False):  # sentence-transformers lowercases in Python, not the tokenizer
            raise ConfigError("this PyLate model lowercases its texts (do_lower_case): save it and load the directory "
                              "with ColBERT.from_pretrained, whose tokenizer does the same")
        config = ColBERTConfig(model.query_prefix, model.document_prefix, model.query_length, model.document_length,
                               model.do_query_expansion, model.attend_to_expansion_tokens, list(model.skiplist_words),
                               dict(model.prompts), model.default_prompt_name)
        dense = []
        for m in modules[1:]:
            residual = getattr(m, "residual", None)
            dense.append(Dense(m.linear.weight.detach().float(), None if m.linear.bias is None
                               else m.linear.bias.detach().float(), type(m.activation_function).__name__,
                               None if residual is None else residual.weight.detach().float(),
                               bool(getattr(m, "use_residual", False))))
        encoder = Encoder.from_hf(hf, backend=backend, dtype=dtype, add_pooling_layer=False)
        encoder._tokenizer = Tokenizer.from_str(model.tokenizer.backend_tokenizer.to_str())
        special = {name: getattr(model.tokenizer, name, None) for name in SPECIAL_TOKENS}
        return cls(encoder, config, dense, special)

    def extra_repr(self):
        c = self.colbert
        return (f"dim={self.dim}, query_length={c.query_length}, document_length={c.document_length}, "
                f"expansion={c.do_query_expansion}, attend_to_expansion={c.attend_to_expansion_tokens}, "
                f"backend={self.encoder.backend!r}")

    def token_ids(self, texts: list[str], is_query: bool = True) -> tuple[list[list[int]], list[bool]]:
        """texts -> (each text's token ids before padding, whether it was truncated), as PyLate's tokenize: each text
        stripped, truncated to query_length / document_length, the prefix token after the first."""
        prefix = self.query_prefix_id if is_query else self.document_prefix_id
        tok = self._tokenizers[bool(is_query)]  # encode_batch_fast (tokenizers >= 0.20): no character offsets
        encodings = getattr(tok, "encode_batch_fast", tok.encode_batch)([str(t).strip() for t in texts])
        rows = []
        for e in encodings:
            ids = list(e.ids)
            if prefix is not None:
                ids[1:1] = [prefix]
            rows.append(ids)
        return rows, [bool(e.overflowing) for e in encodings]

    def pad(self, rows: list[list[int]], is_query: bool = True):
        """`token_ids`' rows -> (input_ids, attention_mask, token_type_ids), each (N, width) int64 on the model's
        device: right padded with the pad token; queries with expansion to query_length (attention mask 0 there, or 1
        when the model attends to the expansion). Token types are 0 (one text per row)."""
        c = self.colbert
        expand = is_query and c.do_query_expansion
        width = c.query_length if expand else max((len(r) for r in rows), default=0)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask, types = np.zeros_like(ids), np.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        if expand and c.attend_to_expansion_tokens:
            mask[:] = 1
        device = self.encoder.device
        return tuple(torch.from_numpy(a).to(device) for a in (ids, mask, types))

    def tokenize(self, texts: list[str], is_query: bool = True):
        """texts -> (input_ids, attention_mask, token_type_ids), each (N, width) int64, as PyLate's tokenize:
        `pad(token_ids(texts, is_query)[0], is_query)`."""
        return self.pad(self.token_ids(texts, is_query)[0], is_query)

    @torch.inference_mode()
    def embed_tokens(self, input_ids, attention_mask, token_type_ids=None, is_query: bool = True,
                     normalize: bool = True, adapter_ids=None) -> list[torch.Tensor]:
        """Texts already tokenized (`tokenize`'s (N, S) int64 tensors) -> per text its (tokens, dim) float32 vectors:
        a query's every position with expansion (else its real tokens), a document's real tokens outside the
        skiplist. adapter_ids: as `Encoder.forward`'s (LoRA adapters of `self.encoder.load_adapter`). A text's
        vectors depend on that text and its adapter alone."""
        expand = is_query and self.colbert.do_query_expansion
        run_mask, key_mask = attention_mask, None
        if expand and not self.colbert.attend_to_expansion_tokens:  # the [MASK]s are computed, never attended to
            run_mask, key_mask = torch.ones_like(attention_mask), attention_mask
        types = token_type_ids if self.encoder.config.type_vocab_size else None
        last = self.encoder._run(input_ids, run_mask, types, None, False, pool=False, stream=True,
                                  key_mask=key_mask, adapter_ids=adapter_ids)[0]
        keep = run_mask.bool()
        if not is_query and self.skiplist:
            keep = keep & ~torch.isin(input_ids, torch.tensor(self.skiplist, device=input_ids.device))
        x = last[keep.to(last.device)].float().contiguous()  # [T, H] the kept tokens, row by row
        for linear, act, residual in self.dense:
            res = x if residual == "input" else None if residual is None else residual(x)
            x = linear(x, act, res)
        if normalize:
            x = F.normalize(x, p=2, dim=1)
        return list(x.split(keep.sum(1).tolist()))

    def encode(self, sentences, *, is_query: bool = True, prompt_name: str | None = None, prompt: str | None = None,
               batch_size: int = 32, show_progress_bar: bool | None = None, convert_to_numpy: bool = True,
               convert_to_tensor: bool = False, normalize_embeddings: bool = True, adapter=None,
               workers: int | None = None):
        """Per text its (tokens, dim) float32 token vectors, as PyLate's `ColBERT.encode`: sentences (a string or a
        list of strings) -> a list of NumPy arrays (convert_to_tensor=True or convert_to_numpy=False: torch tensors);
        one string -> one array. is_query: the query rules (prefix, expansion), else the document's (prefix,
        skiplist). prompt / prompt_name prepend a prompt as PyLate does. adapter: a LoRA adapter's name
        (`self.encoder.load_adapter`) for every text, or one name or None per text (None: `encoder.default_adapter`).
        Batches of batch_size texts, longest first; a text's vectors do not depend on its batch. workers: threads
        that each run their own batches on a share of the cores, as `Encoder.encode`'s (`bertfast.workers`; None: one
        per torch thread, on the cpu backend); the same bits whatever the workers."""
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"ColBERT.encode takes a string or a list of strings; item {bad[0]} is "
                            f"{type(texts[bad[0]]).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(is_query, bool):
            raise TypeError(f"is_query must be True or False, got {is_query!r}")
        adapters = self.encoder._text_adapters(adapter, len(texts))
        text = resolve_prompt(self.colbert.prompts, self.colbert.default_prompt_name, prompt, prompt_name)
        if text:
            texts = [text + t for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        starts = range(0, len(texts), batch_size)
        workers, threads = plan(self.encoder.device, len(starts), workers, self.encoder.backend)
        numpy = convert_to_numpy and not convert_to_tensor

        def run(start):
            group = order[start:start + batch_size]
            vectors = self.embed_tokens(*self.tokenize([texts[i] for i in group], is_query), is_query=is_query,
                                        normalize=normalize_embeddings,
                                        adapter_ids=None if adapters is None else [adapters[i] for i in group])
            return group, [v.cpu().numpy() if numpy else v for v in vectors]

        results = ordered_map(run, starts, workers, threads)
        if show_progress_bar:
            from tqdm.auto import tqdm

            results = tqdm(results, total=len(starts), desc=f"Encoding {'queries' if is_query else 'documents'}",
                           unit="batch")
        out = [None] * len(texts)
        for group, vectors in results:
            for i, v in zip(group, vectors):
                out[i] = v
        return out[0] if single else out


__all__ = ["ColBERT", "ColBERTConfig", "is_colbert_checkpoint", "read_colbert_config"]
