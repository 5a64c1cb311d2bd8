"""The served model: loading and warm-up on the engine thread, tokenization and checks on request
threads, and the batch call, all through the public API: `Encoder` (`tokenize`'s tokenizer,
`embed_tokens`, `sentence_config`; its forward's `last_hidden_state` for /embed_all) for embedding models, `bertfast.load`'s `TaskModel` (logits,
`labels`, `scores`) for sequence classifiers and cross-encoders, `bertfast.SparseEncoder` (`embed_tokens`) for
SPLADE models.

What the model is (`kind`) is decided once, at load, from config.json as TEI decides it: an
architecture `*ForSequenceClassification` is a classifier, a reranker when it has one label; a
sentence-transformers SparseEncoder with SpladePooling (modules.json) is a sparse model; any other architecture is
an embedding model. A row's result depends on that row alone (the engine and the
sequence heads are batch-invariant), so rows of different requests share a batch and still equal
`Encoder.encode` / the TaskModel on the row alone.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .schemas import ApiError

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING, CLASSIFIER, RERANKER, SPARSE = "embedding", "classifier", "reranker", "sparse"
# The model routes each kind answers (/tokenize, /info, /health, /metrics: every kind).
ROUTES = {EMBEDDING: ("/embed", "/embed_all", "/v1/embeddings"), CLASSIFIER: ("/predict",),
          RERANKER: ("/rerank", "/predict"), SPARSE: ("/embed_sparse",)}
# Batch keys of classifier rows: probabilities (the TaskModel's softmax/sigmoid) or the raw logits. Both
# are computed on the engine thread: torch ops on another thread would start a second OpenMP team.
SCORES, LOGITS = ("scores",), ("logits",)
# Batch key of SPLADE rows: (N, vocab) dense vectors, the checkpoint's max_active_dims applied.
SPLADE = ("splade",)
# Batch key of /embed_all rows: each row's (len(row), hidden) final hidden states (Encoder's last_hidden_state).
TOKENS = ("tokens",)


class ServedModel:
    """A model behind the server. Construct anywhere; `load()` runs on the engine thread."""

    def __init__(self, path: str, *, backend: str = "auto", dtype=None, pooling=None, model_id: str | None = None):
        self.path, self.backend_name, self.dtype_arg = path, backend, dtype
        self.pooling = pooling
        self.model_id = model_id or os.path.basename(os.path.normpath(path))
        self.encoder = self.task = self.sparse = self.kind = self.architecture = self.labels = None
        self.dimension = self.normalizes = None

    # --- engine thread ---
    def load(self):
        """Load, build the tokenizers, warm up (short and full-length rows); returns the batch runner."""
        import bertfast
        from bertfast.config import read_config_json
        from bertfast.sentence import pooling_modes
        from bertfast.splade import is_sparse_checkpoint
        from bertfast.tokenization import unpadded

        archs = read_config_json(self.path).get("architectures") or []
        self.architecture = archs[0] if archs else None
        if self.architecture and self.architecture.endswith("ForSequenceClassification"):
            self.task = bertfast.load(self.path, backend=self.backend_name, dtype=self.dtype_arg)
            self.labels = list(self.task.labels)
            self.kind = RERANKER if len(self.labels) == 1 else CLASSIFIER
            if self.pooling is not None:
                logging.getLogger("bertfast.serve").warning(
                    "--pooling is ignored: this model is a %s (%s), not an embedding model", self.kind,
                    self.architecture)
                self.pooling = None
            enc = self.task.encoder
        elif is_sparse_checkpoint(self.path):
            self.sparse = bertfast.SparseEncoder.from_pretrained(self.path, backend=self.backend_name,
                                                                 dtype=self.dtype_arg)
            self.kind, self.pooling, enc = SPARSE, None, self.sparse.encoder
            self.dimension = self.sparse.vocab_size
        else:
            enc = bertfast.Encoder.from_pretrained(self.path, backend=self.backend_name, dtype=self.dtype_arg)
            self.kind = EMBEDDING
            self.pooling = None if self.pooling is None else pooling_modes(self.pooling)
            self.dimension = enc.sentence_config.dimension(enc.config.hidden_size, self.pooling)
            self.normalizes = enc.sentence_config.normalizes
        tok = enc.tokenizer
        self.tokenizers = {"right": unpadded(tok, "right"), "left": unpadded(tok, "left")}
        self.limit = tok.truncation["max_length"]
        self.pad_id = tok.padding["pad_id"] if tok.padding else 0
        self.encoder = enc
        key = SCORES if self.task is not None else SPLADE if self.sparse is not None else self.key()
        for rows in ([self.tokenizers["right"].encode("warm up").ids], [[self.pad_id + 1] * self.limit]):
            self.run(key, rows, [None] * len(rows))
        return self.run

    def run(self, key: tuple, rows: list[list[int]], types: list[list[int] | None]):
        """Rows of token ids (and token type ids, None: all 0) -> (len(rows), D) float32 embeddings, or
        (len(rows), labels) float32 scores (key SCORES) or logits (LOGITS), or (key TOKENS) a list of each row's
        (len(row), hidden) float32 final hidden states; right padded into one batch."""
        import torch

        longest = max(len(r) for r in rows)
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        token_types = np.zeros((len(rows), longest), dtype=np.int64)
        for i, (r, t) in enumerate(zip(rows, types)):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
            if t is not None:
                token_types[i, :len(t)] = t
        ids, mask, token_types = (torch.from_numpy(a) for a in (ids, mask, token_types))
        if key in (SCORES, LOGITS):
            typed = token_types if self.encoder.config.type_vocab_size else None  # families without token types
            logits = self.task(ids, mask, typed).logits
            return (self.task.scores(logits) if key == SCORES else logits.float()).cpu().numpy()
        if key == TOKENS:
            with torch.inference_mode():
                states = self.encoder(ids, mask).last_hidden_state.float().cpu().numpy()
            return [states[i, :len(r)] for i, r in enumerate(rows)]
        if key == SPLADE:
            from bertfast.splade import top_k

            return top_k(self.sparse.embed_tokens(ids, mask, token_types), self.sparse.splade.max_active_dims).numpy()
        normalize, truncate_dim, prompt_length = key
        out = self.encoder.embed_tokens(ids, mask, token_types, pooling=self.pooling, normalize=normalize,
                                        truncate_dim=truncate_dim, prompt_length=prompt_length)
        return out.cpu().numpy()

    # --- request threads ---
    def key(self, normalize: bool | None = None, truncate_dim: int | None = None, prompt_length: int | None = None):
        """The parameters that rows of one batch must share."""
        return normalize, truncate_dim, prompt_length

    def prompt(self, prompt_name: str | None) -> tuple[str | None, int | None]:
        """(prompt text, its token count) for a prompt name (None: the model's default prompt, if any)."""
        from bertfast.tokenization import prompt_length

        try:
            prompts = self.sparse.splade if self.sparse is not None else self.encoder.sentence_config
            text = prompts.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise ApiError(422, str(e), field="prompt_name") from None
        return (text, prompt_length(self.encoder.tokenizer, text)) if text else (None, None)

    def tokenize(self, texts: list, *, truncate: bool = False, direction: str = "right",
                 field: str = "inputs", add_special_tokens: bool = True):
        """Texts or pairs (text_a, text_b) -> their encodings (tokenizers.Encoding, unpadded; a pair's
        `type_ids` mark its second text); 413 naming field[i] for an input over the model's limit unless
        truncate (a pair is truncated longest text first)."""
        encodings = self.tokenizers[direction.lower()].encode_batch(texts, add_special_tokens=add_special_tokens)
        if not truncate:
            for i, (text, e) in enumerate(zip(texts, encodings)):
                if e.overflowing:
                    pair = " (its two texts together)" if isinstance(text, tuple) else ""
                    raise ApiError(413, f"{field}[{i}] has more than {self.limit} tokens{pair}, the model's limit: "
                                   "shorten it or send truncate=true", field=f"{field}[{i}]", limit=self.limit)
        return encodings

    def description(self) -> str:
        """What the model is, for errors and logs."""
        arch = self.architecture or "no architectures in config.json"
        if self.kind == CLASSIFIER:
            return f"a classifier ({arch}, {len(self.labels)} labels)"
        if self.kind == RERANKER:
            return f"a reranker ({arch} with one label: a cross-encoder)"
        if self.kind == SPARSE:
            return f"a sparse (SPLADE) model ({arch} with SpladePooling)"
        return f"an embedding model ({arch})"

    def check_ids(self, rows: list[list[int]], field: str = "input") -> list[list[int]]:
        """Token id lists as given (special tokens included): in the vocabulary, 1 to limit long."""
        vocab = self.encoder.config.vocab_size
        for i, r in enumerate(rows):
            where = f"{field}[{i}]" if len(rows) > 1 else field
            if not r:
                raise ApiError(422, f"{where} is an empty list of token ids", field=where)
            if len(r) > self.limit:
                raise ApiError(413, f"{where} has {len(r)} tokens, more than the model's limit of {self.limit}",
                               field=where, limit=self.limit)
            bad = next((t for t in r if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(422, f"{where} holds token id {bad}, outside the vocabulary [0, {vocab})",
                               field=where, limit=vocab)
        return rows

    def info(self) -> dict:
        import bertfast

        enc, cpu = self.encoder, bertfast.cpu_info()
        pooling = None if self.kind != EMBEDDING else list(self.pooling or enc.sentence_config.pooling)
        if self.kind == SPARSE:
            pooling = [f"splade_{self.sparse.splade.pooling}"]
        return dict(model_id=self.model_id, model_dir=self.path, model_type=self.kind, architecture=self.architecture,
                    routes=list(ROUTES[self.kind]), labels=self.labels, dimension=self.dimension,
                    max_input_length=self.limit, pooling=pooling, normalizes=self.normalizes,
                    dtype="int8" if enc.quantize else str(enc.dtype).replace("torch.", ""), backend=enc.backend,
                    isa=cpu["active"] or "none", cpu=cpu["cpu"] or "unknown", version=bertfast.__version__)
