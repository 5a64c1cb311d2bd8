"""The served model: loading and warm-up on the engine thread, tokenization and checks on request
threads, and the batch call, all through the public API: `Encoder` (`tokenize`'s tokenizer, `embed_tokens`,
`sentence_config`; its forward's `last_hidden_state` for /embed_all) for embedding models, `bertfast.load`'s
`TaskModel` (logits, `labels`, `scores`) for sequence classifiers and cross-encoders, `bertfast.SparseEncoder`
(`embed_tokens`) for SPLADE models, `bertfast.ColBERT` (`token_ids`, `pad`, `embed_tokens`) for PyLate ColBERT models
and `bertfast.BGEM3` (`encode_tokens`) for BGE-M3.

What the model is (`kind`) is decided once, at load, in `kind_of`, from config.json as TEI decides it: an
architecture `*ForSequenceClassification` is a classifier, a reranker when it has one label; a directory with
BGE-M3's head files (sparse_linear.pt, colbert_linear.pt) is BGE-M3; a modules.json of a Transformer then Dense
projections only (PyLate's stack) is a ColBERT model; a sentence-transformers SparseEncoder with SpladePooling is a
sparse model; anything else is an embedding model. A row's result depends on that row alone (the engine and the
sequence heads are batch-invariant), so rows of different requests share a batch and still equal
`Encoder.encode` / the TaskModel on the row alone. Every kind may carry LoRA adapters (`--adapter`), loaded with it
on the engine thread by the object that owns them (`adapted`: the TaskModel or the SparseEncoder, which also take an
adapter's head, else the Encoder, ColBERT's and BGE-M3's included); each row of a batch runs with its own adapter or
none (`embed_tokens`', `encode_tokens`' and the forwards' `adapter_ids`), the same bits as the model's `encode(...,
adapter=)` or the TaskModel's forward with `adapter_ids=[adapter]` on the row alone.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .schemas import ApiError

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING, CLASSIFIER, RERANKER, SPARSE = "embedding", "classifier", "reranker", "sparse"
COLBERT, BGEM3 = "colbert", "bge-m3"
# The model routes each kind answers (/tokenize, /info, /health, /metrics: every kind).
ROUTES = {EMBEDDING: ("/embed", "/embed_all", "/v1/embeddings"), CLASSIFIER: ("/predict",),
          RERANKER: ("/rerank", "/predict"), SPARSE: ("/embed_sparse",), COLBERT: ("/embed_multi",),
          BGEM3: ("/embed", "/embed_sparse", "/embed_multi")}
# The route each kind answers at POST / and /invocations, as TEI's router picks it by model type (ColBERT: its one).
DEFAULT_ROUTE = {EMBEDDING: "/embed", CLASSIFIER: "/predict", RERANKER: "/rerank", SPARSE: "/embed_sparse",
                 COLBERT: "/embed_multi", BGEM3: "/embed"}
# Batch keys of classifier rows: probabilities (the TaskModel's softmax/sigmoid) or the raw logits. Both
# are computed on the engine thread: torch ops on another thread would start a second OpenMP team.
SCORES, LOGITS = ("scores",), ("logits",)
# Batch key of SPLADE rows: (N, vocab) dense vectors, the checkpoint's max_active_dims applied.
SPLADE = ("splade",)
# Batch key of /embed_all rows: each row's (len(row), hidden) final hidden states (Encoder's last_hidden_state).
TOKENS = ("tokens",)
# Batch key of BGE-M3's /embed_sparse rows: each row's lexical weights ({str(token id): weight}, BGEM3.encode's).
LEXICAL = ("lexical",)
# Batch keys of /embed_multi rows, (MULTI, is_query): each row's (tokens, dim) normalized token vectors.
MULTI = "multi"


def kind_of(path: str) -> tuple[str, str | None]:
    """(what the model directory is, its architecture): the one place the server decides it (see above; a
    classifier's reranker-or-not is decided once its labels are read)."""
    from bertfast.bgem3 import is_bgem3_checkpoint
    from bertfast.colbert import is_colbert_checkpoint
    from bertfast.config import read_config_json
    from bertfast.splade import is_sparse_checkpoint

    archs = read_config_json(path).get("architectures") or []
    architecture = archs[0] if archs else None
    if architecture and architecture.endswith("ForSequenceClassification"):
        return CLASSIFIER, architecture
    for kind, found in ((BGEM3, is_bgem3_checkpoint), (COLBERT, is_colbert_checkpoint), (SPARSE, is_sparse_checkpoint)):
        if found(path):
            return kind, architecture
    return EMBEDDING, architecture


class ServedModel:
    """A model behind the server. Construct anywhere; `load()` runs on the engine thread."""

    def __init__(self, path: str, *, backend: str = "auto", dtype=None, pooling=None, model_id: str | None = None,
                 adapters: dict[str, str] | None = None):
        self.path, self.backend_name, self.dtype_arg = path, backend, dtype
        self.pooling = pooling
        self.adapter_paths = dict(adapters or {})  # name -> PEFT LoRA directory, loaded with the model
        self.model_id = model_id or os.path.basename(os.path.normpath(path))
        self.encoder = self.task = self.sparse = self.kind = self.architecture = self.labels = None
        self.colbert = self.m3 = self.dimension = self.normalizes = self.native = None

    # --- engine thread ---
    def load(self):
        """Load, build the tokenizers, warm up (short and full-length rows); returns the batch runner."""
        import bertfast
        from bertfast.sentence import pooling_modes
        from bertfast.tokenization import NativeWordPiece, unpadded

        self.kind, self.architecture = kind_of(self.path)
        if self.kind != EMBEDDING and self.pooling is not None:
            logging.getLogger("bertfast.serve").warning(
                "--pooling is ignored: this model is a %s (%s), not an embedding model", self.kind, self.architecture)
            self.pooling = None
        options = dict(backend=self.backend_name, dtype=self.dtype_arg)
        if self.kind == CLASSIFIER:
            self.task = bertfast.load(self.path, **options)
            self.labels = list(self.task.labels)
            self.kind = RERANKER if len(self.labels) == 1 else CLASSIFIER
            enc = self.task.encoder
        elif self.kind == BGEM3:
            self.m3 = bertfast.BGEM3.from_pretrained(self.path, **options)
            enc, self.normalizes = self.m3.encoder, self.m3.normalize_embeddings
            self.dimension = enc.config.hidden_size
        elif self.kind == COLBERT:
            self.colbert = bertfast.ColBERT.from_pretrained(self.path, **options)
            enc, self.dimension, self.normalizes = self.colbert.encoder, self.colbert.dim, True
        elif self.kind == SPARSE:
            self.sparse = bertfast.SparseEncoder.from_pretrained(self.path, **options)
            enc, self.dimension = self.sparse.encoder, self.sparse.vocab_size
        else:
            enc = bertfast.Encoder.from_pretrained(self.path, **options)
            self.pooling = None if self.pooling is None else pooling_modes(self.pooling)
            self.dimension = enc.sentence_config.dimension(enc.config.hidden_size, self.pooling)
            self.normalizes = enc.sentence_config.normalizes
        self.encoder = enc
        for name, adapter_path in self.adapter_paths.items():
            self.load_adapter(name, adapter_path)  # LoadError naming the tensor, shape or field that does not fit
        tok = enc.tokenizer
        self.tokenizers = {"right": unpadded(tok, "right"), "left": unpadded(tok, "left")}
        self.limit = tok.truncation["max_length"]
        self.native = NativeWordPiece.of(tok) if self.limit >= 2 else None  # ASCII texts' ids, `text_ids`
        self.pad_id = tok.padding["pad_id"] if tok.padding else 0
        for key, rows in self.warm_up():
            self.run(key, rows, [None] * len(rows), [None] * len(rows))
        return self.run

    def warm_up(self) -> list[tuple[tuple, list[list[int]]]]:
        """(key, rows) batches that warm the model up: a short row and rows of the longest length it takes."""
        if self.colbert is not None:
            long = "warm up " * self.colbert.colbert.document_length
            return [((MULTI, q), self.colbert.token_ids(["warm up", long], q)[0]) for q in (True, False)]
        short, long = [self.tokenizers["right"].encode("warm up").ids], [[self.pad_id + 1] * self.limit]
        if self.m3 is not None:  # its three head paths: both heads, the sparse head alone, none
            return [((MULTI, None), short), ((MULTI, None), long), (LEXICAL, short), (self.key(), short)]
        key = SCORES if self.task is not None else SPLADE if self.sparse is not None else self.key()
        return [(key, short), (key, long)]

    @property
    def adapted(self):
        """What owns the model's LoRA adapters: the TaskModel of a classifier or reranker, the SparseEncoder of a
        SPLADE model (the encoder's LoRA and the adapter's head), else the Encoder; None before `load()`."""
        if self.encoder is None:
            return None
        return next(m for m in (self.task, self.sparse, self.encoder) if m is not None)

    @property
    def adapters(self) -> list[str]:
        """The names of the model's LoRA adapters (none before `load()`)."""
        return self.adapted.adapters if self.adapted is not None else []

    def load_adapter(self, name: str, path: str) -> None:
        """Engine thread: load the PEFT LoRA directory `path` as adapter `name` (`Encoder.load_adapter`, or
        `TaskModel.load_adapter` / `SparseEncoder.load_adapter` with its head); raises what they raise (LoadError, a
        ValueError)."""
        self.adapted.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Engine thread: forget adapter `name` (and its head)."""
        self.adapted.unload_adapter(name)

    def run(self, key: tuple, rows: list[list[int]], types: list[list[int] | None],
            adapters: list[str | None] | None = None):
        """Rows of token ids (and token type ids, None: all 0; each row's adapter name, None: the base model) ->
        (len(rows), D) float32 embeddings, or
        (len(rows), labels) float32 scores (key SCORES) or logits (LOGITS), or (key TOKENS) a list of each row's
        (len(row), hidden) float32 final hidden states, or (key (MULTI, is_query)) a list of each row's (tokens, dim)
        float32 token vectors, or (key LEXICAL) a list of each row's lexical weights; right padded into one batch."""
        import torch

        adapter_ids = adapters if adapters is not None and any(a is not None for a in adapters) else None
        if self.colbert is not None:  # PyLate's padding: queries expanded to query_length
            is_query = key[1]
            vectors = self.colbert.embed_tokens(*self.colbert.pad(rows, is_query), is_query=is_query,
                                                adapter_ids=adapter_ids)
            return [v.cpu().numpy() for v in vectors]
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
            logits = self.task(ids, mask, typed, adapter_ids=adapter_ids).logits
            return (self.task.scores(logits) if key == SCORES else logits.float()).cpu().numpy()
        if key == TOKENS:
            with torch.inference_mode():
                # JSON carries fp32: under bf16 the cpu backend's fp32 stream, not its rounding
                states = self.encoder(ids, mask, adapter_ids=adapter_ids,
                                      output_dtype=torch.float32).last_hidden_state.cpu().numpy()
            return [states[i, :len(r)] for i, r in enumerate(rows)]
        if self.m3 is not None:
            multi, lexical = key[0] == MULTI, key == LEXICAL
            normalize = None if multi or lexical else key[0]  # /embed's normalize (the rest: the model's)
            out = self.m3.encode_tokens(ids, mask, return_dense=not (multi or lexical), return_sparse=lexical,
                                        return_colbert_vecs=multi, normalize=normalize, adapter_ids=adapter_ids)
            return out["colbert_vecs" if multi else "lexical_weights" if lexical else "dense_vecs"]
        if key == SPLADE:
            from bertfast.splade import top_k

            vectors = self.sparse.embed_tokens(ids, mask, token_types, adapter_ids=adapter_ids)
            return top_k(vectors, self.sparse.splade.max_active_dims).numpy()
        normalize, truncate_dim, prompt_length = key
        out = self.encoder.embed_tokens(ids, mask, token_types, pooling=self.pooling, normalize=normalize,
                                        truncate_dim=truncate_dim, prompt_length=prompt_length,
                                        adapter_ids=adapter_ids)
        return out.cpu().numpy()

    # --- request threads ---
    def key(self, normalize: bool | None = None, truncate_dim: int | None = None, prompt_length: int | None = None):
        """The parameters that rows of one batch must share."""
        return normalize, truncate_dim, prompt_length

    def prompt(self, prompt_name: str | None) -> tuple[str | None, int | None]:
        """(prompt text, its token count) for a prompt name (None: the model's default prompt, if any)."""
        from bertfast.tokenization import prompt_length

        from bertfast.sentence import resolve_prompt

        try:
            if self.colbert is not None:
                text = resolve_prompt(self.colbert.colbert.prompts, self.colbert.colbert.default_prompt_name, None,
                                      prompt_name)
            elif self.m3 is not None:  # BGEM3.encode prepends nothing: no prompts
                text = resolve_prompt({}, None, None, prompt_name)
            else:
                prompts = self.sparse.splade if self.sparse is not None else self.encoder.sentence_config
                text = prompts.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise ApiError(422, str(e), field="prompt_name") from None
        return (text, prompt_length(self.encoder.tokenizer, text)) if text else (None, None)

    def tokenize(self, texts: list, *, truncate: bool = False, direction: str = "right",
                 field: str | list[str] = "inputs", add_special_tokens: bool = True):
        """Texts or pairs (text_a, text_b) -> their encodings (tokenizers.Encoding, unpadded; a pair's
        `type_ids` mark its second text); 413 naming field[i] (or field[i] itself, a list of one name per text) for
        an input over the model's limit unless truncate (a pair is truncated longest text first)."""
        encodings = self.tokenizers[direction.lower()].encode_batch(texts, add_special_tokens=add_special_tokens)
        if not truncate:
            self._check_length(texts, [bool(e.overflowing) for e in encodings], field)
        return encodings

    def text_ids(self, texts: list[str], *, truncate: bool = False, direction: str = "right",
                 field: str | list[str] = "inputs") -> list[list[int]]:
        """Texts -> their token id rows, as `tokenize(...)`'s ids (413 the same way): ASCII texts by the native
        WordPiece where the model's tokenizer has one (`NativeWordPiece`), the others by the tokenizers library."""
        if self.native is None or not all(isinstance(t, str) for t in texts):
            return [e.ids for e in self.tokenize(texts, truncate=truncate, direction=direction, field=field)]
        rows, over = self.native.rows(texts, self.limit, self.tokenizers[direction.lower()])
        if not truncate:
            self._check_length(texts, over, field)
        return rows

    def _check_length(self, texts: list, over: list[bool], field: str | list[str]):
        """413 naming field[i] (or field[i] of a list of names) for the first input over the model's limit."""
        if any(over):
            i = over.index(True)
            where = field[i] if isinstance(field, list) else f"{field}[{i}]"
            pair = " (its two texts together)" if isinstance(texts[i], tuple) else ""
            raise ApiError(413, f"{where} has more than {self.limit} tokens{pair}, the model's limit: "
                           "shorten it or send truncate=true", field=where, limit=self.limit)

    def multi_rows(self, texts: list[str], *, is_query: bool | None, truncate: bool = False,
                   field: str = "inputs") -> list[list[int]]:
        """Texts -> token id rows for /embed_multi: a ColBERT model's (`ColBERT.token_ids`: the prefix token, no
        padding yet; 413 naming field[i] for a text over query_length / document_length unless truncate), BGE-M3's
        (the tokenizer's, as `tokenize`)."""
        if self.colbert is None:
            return self.text_ids(texts, truncate=truncate, field=field)
        rows, cut = self.colbert.token_ids(texts, is_query)
        if not truncate and any(cut):
            i, c = cut.index(True), self.colbert.colbert
            name, limit = ("query_length", c.query_length) if is_query else ("document_length", c.document_length)
            raise ApiError(413, f"{field}[{i}] has more than {limit} tokens (the prefix token included), the model's "
                           f"{name}: shorten it or send truncate=true", field=f"{field}[{i}]", limit=limit)
        return rows

    def min_tokens(self, is_query: bool | None) -> int:
        """The tokens each /embed_multi row costs at least: a ColBERT query with expansion runs all query_length."""
        c = None if self.colbert is None else self.colbert.colbert
        return c.query_length if c is not None and is_query and c.do_query_expansion else 0

    def description(self) -> str:
        """What the model is, for errors and logs."""
        arch = self.architecture or "no architectures in config.json"
        if self.kind == CLASSIFIER:
            return f"a classifier ({arch}, {len(self.labels)} labels)"
        if self.kind == RERANKER:
            return f"a reranker ({arch} with one label: a cross-encoder)"
        if self.kind == SPARSE:
            return f"a sparse (SPLADE) model ({arch} with SpladePooling)"
        if self.kind == COLBERT:
            return f"a ColBERT model (PyLate: {arch} then Dense projections to {self.dimension}-wide token vectors)"
        if self.kind == BGEM3:
            return f"a BGE-M3 model ({arch} with sparse_linear.pt and colbert_linear.pt)"
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

    def decode(self, rows: list[list[int]], skip_special_tokens: bool, field: str = "ids") -> list[str]:
        """Token id lists -> their texts (the tokenizer's decode: /tokenize's inverse); 422 naming field[i] for an
        empty list or an id outside the tokenizer's vocabulary (added tokens included)."""
        tok = self.encoder.tokenizer
        vocab = tok.get_vocab_size(with_added_tokens=True)
        for i, r in enumerate(rows):
            where = f"{field}[{i}]" if len(rows) > 1 else field
            if not r:
                raise ApiError(422, f"{where} is an empty list of token ids", field=where)
            bad = next((t for t in r if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(422, f"{where} holds token id {bad}, outside the vocabulary [0, {vocab})",
                               field=where, limit=vocab)
        return tok.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def info(self) -> dict:
        import bertfast

        enc, cpu = self.encoder, bertfast.cpu_info()
        pooling = None if self.kind != EMBEDDING else list(self.pooling or enc.sentence_config.pooling)
        if self.kind == SPARSE:
            pooling = [f"splade_{self.sparse.splade.pooling}"]
        limit, query_length, token_dimension = self.limit, None, None
        if self.kind == COLBERT:
            c = self.colbert.colbert
            limit, query_length, token_dimension, pooling = c.document_length, c.query_length, self.dimension, None
        elif self.kind == BGEM3:
            token_dimension, pooling = self.m3.colbert_dim, ["cls"]
        return dict(model_id=self.model_id, model_dir=self.path, model_type=self.kind, architecture=self.architecture,
                    routes=list(ROUTES[self.kind]), default_route=DEFAULT_ROUTE[self.kind], labels=self.labels,
                    dimension=self.dimension,
                    max_input_length=limit, max_query_length=query_length, token_dimension=token_dimension,
                    pooling=pooling, normalizes=self.normalizes,
                    dtype="int8" if enc.quantize else str(enc.dtype).replace("torch.", ""), backend=enc.backend,
                    isa=cpu["active"] or "none", cpu=cpu["cpu"] or "unknown", version=bertfast.__version__)
