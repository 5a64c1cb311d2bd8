"""The served model: loading and warm-up on the engine thread, tokenization and checks on request
threads, and the batch call, all through the public `Encoder` API (`tokenize`'s tokenizer,
`embed_tokens`, `sentence_config`). A row's vector depends on that row alone (the engine is
batch-invariant), so rows of different requests share a batch and still equal `Encoder.encode`.
"""

from __future__ import annotations

import os

import numpy as np

from .schemas import ApiError

DEFAULT_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


class ServedModel:
    """An embedding model behind the server. Construct anywhere; `load()` runs on the engine thread."""

    def __init__(self, path: str, *, backend: str = "auto", dtype=None, pooling=None, model_id: str | None = None):
        self.path, self.backend_name, self.dtype_arg = path, backend, dtype
        self.pooling = pooling
        self.model_id = model_id or os.path.basename(os.path.normpath(path))
        self.encoder = None

    # --- engine thread ---
    def load(self):
        """Load, build the tokenizers, warm up (short and full-length rows); returns the batch runner."""
        import bertfast
        from bertfast.sentence import pooling_modes
        from bertfast.tokenization import unpadded

        enc = bertfast.Encoder.from_pretrained(self.path, backend=self.backend_name, dtype=self.dtype_arg)
        tok = enc.tokenizer
        self.tokenizers = {"right": unpadded(tok, "right"), "left": unpadded(tok, "left")}
        self.limit = tok.truncation["max_length"]
        self.pad_id = tok.padding["pad_id"] if tok.padding else 0
        cfg = enc.sentence_config
        self.pooling = None if self.pooling is None else pooling_modes(self.pooling)
        self.dimension = cfg.dimension(enc.config.hidden_size, self.pooling)
        self.normalizes = cfg.normalizes
        self.encoder = enc
        for rows in ([self.tokenizers["right"].encode("warm up").ids], [[self.pad_id + 1] * self.limit]):
            self.run(self.key(), rows)
        return self.run

    def run(self, key: tuple, rows: list[list[int]]) -> np.ndarray:
        """Rows of token ids -> (len(rows), D) float32 embeddings, right padded into one batch."""
        import torch

        longest = max(len(r) for r in rows)
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        normalize, truncate_dim, prompt_length = key
        out = self.encoder.embed_tokens(torch.from_numpy(ids), torch.from_numpy(mask),
                                        torch.zeros_like(torch.from_numpy(ids)), pooling=self.pooling,
                                        normalize=normalize, truncate_dim=truncate_dim, prompt_length=prompt_length)
        return out.cpu().numpy()

    # --- request threads ---
    def key(self, normalize: bool | None = None, truncate_dim: int | None = None, prompt_length: int | None = None):
        """The parameters that rows of one batch must share."""
        return normalize, truncate_dim, prompt_length

    def prompt(self, prompt_name: str | None) -> tuple[str | None, int | None]:
        """(prompt text, its token count) for a prompt name (None: the model's default prompt, if any)."""
        from bertfast.tokenization import prompt_length

        try:
            text = self.encoder.sentence_config.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise ApiError(422, str(e), field="prompt_name") from None
        return (text, prompt_length(self.encoder.tokenizer, text)) if text else (None, None)

    def tokenize(self, texts: list[str], *, truncate: bool = False, direction: str = "right",
                 field: str = "inputs", add_special_tokens: bool = True):
        """Texts -> their encodings (tokenizers.Encoding, unpadded); 413 for a text over the model's
        limit unless truncate."""
        encodings = self.tokenizers[direction.lower()].encode_batch(texts, add_special_tokens=add_special_tokens)
        if not truncate:
            for i, e in enumerate(encodings):
                if e.overflowing:
                    raise ApiError(413, f"{field}[{i}] has more than {self.limit} tokens, the model's limit: "
                                   "shorten it or send truncate=true", field=f"{field}[{i}]", limit=self.limit)
        return encodings

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
        return dict(model_id=self.model_id, model_dir=self.path, model_type="embedding", dimension=self.dimension,
                    max_input_length=self.limit,
                    pooling=list(self.pooling or enc.sentence_config.pooling), normalizes=self.normalizes,
                    dtype="int8" if enc.quantize else str(enc.dtype).replace("torch.", ""), backend=enc.backend,
                    isa=cpu["active"] or "none", cpu=cpu["cpu"] or "unknown", version=bertfast.__version__)
