"""BGE-M3: dense, sparse (lexical weights) and ColBERT vectors from one forward, as FlagEmbedding's `BGEM3FlagModel`.

A BGE-M3 checkpoint is an XLM-R model directory plus two heads FlagEmbedding saves beside it: `sparse_linear.pt`
(H -> 1) and `colbert_linear.pt` (H -> D). From the last hidden states: dense = the CLS token's state, normalized;
a token's lexical weight = relu(sparse_linear(state)), kept per token id as its max over the text, ids of the cls,
eos, pad and unk tokens dropped; ColBERT vectors = colbert_linear over every token after CLS, normalized. Both heads
run as one GEMM over the packed tokens (`HeadLinear`: bf16 where the cpu backend's engine is, else fp32; fp32 out),
so every output of a text depends on that text alone (cpu backend: bit for bit).
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .encoder import Encoder
from .head_linear import HeadLinear
from .loading import LoadError
from .profiling import stage
from .sentence import read_json
from .tokenization import token_budget_batches, unpadded
from .workers import ordered_map, plan

HEAD_FILES = {"sparse": "sparse_linear.pt", "colbert": "colbert_linear.pt"}
# The special tokens FlagEmbedding drops from the lexical weights (M3Embedder's _process_token_weights), with
# XLMRobertaTokenizer's defaults where the tokenizer's files do not name them.
UNUSED_TOKENS = {"cls_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
DEFAULT_MAX_LENGTH = 512  # FlagEmbedding's passage_max_length


def check_heads(directory: str) -> None:
    """LoadError naming the head files a BGE-M3 directory lacks."""
    missing = [f for f in HEAD_FILES.values() if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise LoadError(f"{directory}: {' and '.join(missing)} missing; a BGE-M3 checkpoint holds the XLM-R model "
                        f"with {HEAD_FILES['sparse']} and {HEAD_FILES['colbert']} beside it, as FlagEmbedding "
                        "saves them")


def is_bgem3_checkpoint(directory: str) -> bool:
    """Whether `directory` holds BGE-M3's two head files (`check_heads`' rule) beside its model."""
    return all(os.path.isfile(os.path.join(directory, f)) for f in HEAD_FILES.values())


def read_head(directory: str, name: str, hidden: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A head's (weight (N, hidden), bias (N,)) fp32 from FlagEmbedding's torch.save'd nn.Linear state dict."""
    check_heads(directory)
    path = os.path.join(directory, HEAD_FILES[name])
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: one message naming it
        raise LoadError(f"{path}: not a torch state dict ({type(e).__name__}: {e})") from None
    weight, bias = (state.get(k) if isinstance(state, dict) else None for k in ("weight", "bias"))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden:
        raise LoadError(f"{path}: needs 'weight' of shape (out, {hidden}) (an nn.Linear's state dict), got "
                        f"{None if not isinstance(weight, torch.Tensor) else tuple(weight.shape)}")
    if rows is not None and weight.shape[0] != rows:
        raise LoadError(f"{path}: 'weight' has {weight.shape[0]} rows, expected {rows}")
    if bias is None:
        bias = torch.zeros(weight.shape[0])
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
        raise LoadError(f"{path}: 'bias' must have shape ({weight.shape[0]},)")
    return weight.float().contiguous(), bias.float().contiguous()


def special_token_ids(directory: str, tokenizer) -> tuple[int, ...]:
    """Ids of the tokens FlagEmbedding leaves out of the lexical weights: cls, eos, pad and unk as the tokenizer's
    files name them (special_tokens_map.json, tokenizer_config.json), each only where the vocabulary has it."""
    named = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # the second wins, as in transformers
        found = read_json(os.path.join(directory, name), "BGE-M3 tokenizer", False)
        named.update({k: v for k, v in found.items() if k in UNUSED_TOKENS and v is not None})
    ids = []
    for role, default in UNUSED_TOKENS.items():
        token = named.get(role, default)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids.append(token_id)
    return tuple(sorted(set(ids)))


def lexical_weights(ids: np.ndarray, weights: np.ndarray, cu_seqlens: np.ndarray, unused) -> list[dict]:
    """Per text {str(token id): its largest weight} over the text's tokens with a weight > 0, the unused ids left
    out, keys in order of first appearance (FlagEmbedding's `_process_token_weights`, values np.float32).
    ids, weights: (T,) packed tokens; cu_seqlens: (B+1,)."""
    rows = np.repeat(np.arange(len(cu_seqlens) - 1), np.diff(cu_seqlens))
    keep = (weights > 0) & ~np.isin(ids, np.asarray(unused, dtype=ids.dtype))
    keys = rows[keep] * (int(ids.max(initial=0)) + 1) + ids[keep]
    unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    best = np.zeros(len(unique), dtype=np.float32)
    np.maximum.at(best, inverse, weights[keep])
    order = np.argsort(first, kind="stable")
    kept_ids, best, first = ids[keep][first[order]], best[order], first[order]
    splits = np.searchsorted(rows[keep][first], np.arange(1, len(cu_seqlens) - 1))
    return [defaultdict(int, zip(map(str, i.tolist()), w))
            for i, w in zip(np.split(kept_ids, splits), np.split(best, splits))]


def compute_lexical_matching_score(lexical_weights_1, lexical_weights_2):
    """FlagEmbedding's lexical matching score: sum over shared tokens of the product of weights. Two dicts -> a
    float; two lists of dicts -> an (len1, len2) NumPy array."""
    def score(a, b):
        return sum((w * b[t] for t, w in a.items() if t in b), 0)

    if isinstance(lexical_weights_1, dict) and isinstance(lexical_weights_2, dict):
        return score(lexical_weights_1, lexical_weights_2)
    if isinstance(lexical_weights_1, list) and isinstance(lexical_weights_2, list):
        return np.array([[score(a, b) for b in lexical_weights_2] for a in lexical_weights_1])
    raise ValueError("lexical weights must be two dicts or two lists of dicts")


def colbert_score(q_reps, p_reps) -> torch.Tensor:
    """FlagEmbedding's ColBERT score: for each query vector its best dot product over the passage's vectors, summed
    and divided by the query's vector count. q_reps (Nq, D), p_reps (Np, D) NumPy or torch -> a 0-d tensor."""
    q, p = torch.as_tensor(q_reps), torch.as_tensor(p_reps)
    return torch.einsum("in,jn->ij", q, p).max(-1).values.sum() / q.size(0)


class BGEM3(nn.Module):
    """BGE-M3 on bertfast: `encode(texts)` -> FlagEmbedding's dict of 'dense_vecs', 'lexical_weights' and
    'colbert_vecs'. Build it with `from_pretrained(dir)` on a directory as FlagEmbedding saves one."""

    def __init__(self, encoder: Encoder, sparse, colbert, unused_ids, normalize_embeddings: bool = True):
        super().__init__()
        self.encoder, self.unused_ids, self.normalize_embeddings = encoder, tuple(unused_ids), normalize_embeddings
        (sparse_w, sparse_b), (colbert_w, colbert_b) = sparse, colbert
        self.colbert_dim = colbert_w.shape[0]
        # [colbert; sparse]: one GEMM gives both heads; the sparse row alone where ColBERT is not asked for
        self.heads = HeadLinear(encoder, torch.cat([colbert_w, sparse_w]), torch.cat([colbert_b, sparse_b]))
        self.sparse = HeadLinear(encoder, sparse_w, sparse_b)
        self._tokenizers = {}

    @classmethod
    def from_pretrained(cls, path, *, backend: str = "auto", dtype=None, normalize_embeddings: bool = True):
        """A BGE-M3 directory (config.json and weights of an XLM-R model, its tokenizer, sparse_linear.pt,
        colbert_linear.pt). dtype as `Encoder.from_pretrained` (None, "auto", torch.bfloat16, "int8") sets the
        encoder's; the heads run in bf16 under a bf16 engine on the cpu backend, else in fp32 (`HeadLinear`)."""
        path = os.fspath(path)
        check_heads(path)  # before the model: a plain XLM-R directory fails at once
        encoder = Encoder.from_pretrained(path, backend=backend, dtype=dtype, add_pooling_layer=False)
        hidden = encoder.config.hidden_size
        sparse, colbert = read_head(path, "sparse", hidden, rows=1), read_head(path, "colbert", hidden)
        return cls(encoder, sparse, colbert, special_token_ids(path, encoder.tokenizer), normalize_embeddings)

    @classmethod
    def from_flag_embedding(cls, model, *, backend: str = "auto", dtype=None):
        """An in-memory FlagEmbedding `BGEM3FlagModel`: its XLM-R model, heads, tokenizer and normalize_embeddings
        (the weights shared, not copied, where dtype is unchanged)."""
        from tokenizers import Tokenizer

        inner = getattr(model, "model", None)
        if not all(hasattr(inner, name) for name in ("model", "sparse_linear", "colbert_linear")):
            raise ValueError(f"{type(model).__name__} is not a BGEM3FlagModel: it needs .model with the XLM-R model, "
                             "sparse_linear and colbert_linear")
        encoder = Encoder.from_hf(inner.model, backend=backend, dtype=dtype, add_pooling_layer=False)
        hf_tokenizer = model.tokenizer
        tokenizer = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=encoder.config.max_sequence_length)
        encoder._tokenizer = tokenizer
        heads = [(m.weight.detach().float().cpu(), m.bias.detach().float().cpu())
                 for m in (inner.sparse_linear, inner.colbert_linear)]
        roles = [hf_tokenizer.special_tokens_map[r] for r in UNUSED_TOKENS if r in hf_tokenizer.special_tokens_map]
        unused = [i for i in hf_tokenizer.convert_tokens_to_ids(roles) if i is not None]
        return cls(encoder, heads[0], heads[1], unused, bool(getattr(inner, "normalize_embeddings", True)))

    @property
    def max_length(self) -> int:
        """The most tokens a text may have (the position table's size less XLM-R's offset)."""
        return self.encoder.config.max_sequence_length

    def extra_repr(self):
        return (f"hidden={self.encoder.config.hidden_size}, colbert_dim={self.colbert_dim}, "
                f"dtype={self.encoder.dtype}, backend={self.encoder.backend!r}")

    @torch.inference_mode()
    def embed_tokens(self, input_ids, attention_mask, *, sparse: bool = True, colbert: bool = True,
                     normalize: bool | None = None, adapter_ids=None):
        """Texts already tokenized (right padded, each row starting with CLS) -> (dense (N, H) fp32, token weights
        (T,) fp32 or None, ColBERT vectors (T - N, D) fp32 or None, cu_seqlens (N+1,) int32). T counts the real
        tokens (row-major, as `padding.unpad` packs them); ColBERT vectors leave each row's first token out. Dense
        and ColBERT vectors normalized when normalize (None: the model's normalize_embeddings). adapter_ids: as
        `Encoder.forward`'s (LoRA adapters of `self.encoder.load_adapter`). A row's outputs depend on it (and its
        adapter) alone."""
        if attention_mask.shape[0] and int(attention_mask.sum(1).min()) == 0:
            raise ValueError("every row needs at least one real token (its CLS)")
        last, cu_seqlens = self.encoder._run_packed(input_ids, attention_mask, adapter_ids=adapter_ids)
        with stage("bgem3 heads"):
            x = last.float().contiguous()
            first = cu_seqlens[:-1].long()
            dense = x.index_select(0, first)
            weights = vectors = None
            if colbert:
                out = self.heads(x)
                rest = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
                rest[first] = False
                vectors = out[rest, :self.colbert_dim]
                weights = torch.relu(out[:, self.colbert_dim]) if sparse else None
            elif sparse:
                weights = torch.relu(self.sparse(x)[:, 0])
            if self.normalize_embeddings if normalize is None else normalize:
                dense = F.normalize(dense, dim=-1)
                vectors = None if vectors is None else F.normalize(vectors, dim=-1)
        return dense, weights, vectors, cu_seqlens

    def _tokenizer(self, max_length: int):
        if max_length not in self._tokenizers:
            tok = unpadded(self.encoder.tokenizer)
            tok.enable_truncation(max_length=max_length)
            self._tokenizers[max_length] = tok
        return self._tokenizers[max_length]

    def encode(self, sentences, *, batch_size: int = 256, batch_tokens: int | None = None,
               max_length: int | None = None, return_dense: bool = True, return_sparse: bool = True,
               return_colbert_vecs: bool = False, show_progress_bar: bool | None = None, adapter=None,
               workers: int | None = None):
        """FlagEmbedding's `BGEM3FlagModel.encode`: sentences (a string or a list) -> {'dense_vecs': (N, H) float32
        NumPy, 'lexical_weights': [{str(token id): np.float32 weight}], 'colbert_vecs': [(n_tokens - 1, D) float32
        NumPy]}, None for an output not asked for; one string gives one vector, dict and array. max_length: tokens
        per text (None: 512, at most the model's limit). Batches of batch_size texts, longest first (in tokens), or
        with batch_tokens as many as fit that many padded tokens (`tokenization.token_budget_batches`); the outputs
        do not depend on the batching. Unlike FlagEmbedding's default, sparse weights are on by default.
        show_progress_bar: None shows a bar on a terminal for 8 batches or more. adapter: a LoRA adapter's name
        (`self.encoder.load_adapter`) for every text, or one name or None per text (None: `encoder.default_adapter`).
        workers: threads that each run their own batches, heads and outputs included, on a share of the cores, as
        `Encoder.encode`'s (`bertfast.workers`; None: one per torch thread, on the cpu backend); the same bits
        whatever the workers."""
        if not (return_dense or return_sparse or return_colbert_vecs):
            raise ValueError("ask for at least one of return_dense, return_sparse, return_colbert_vecs")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length is None:
            max_length = min(DEFAULT_MAX_LENGTH, self.max_length)
        if not 2 <= max_length <= self.max_length:
            raise ValueError(f"max_length must be in [2, {self.max_length}] (this model's positions), got {max_length}")
        single = isinstance(sentences, str)
        texts = [sentences] if single else list(sentences)
        adapters = self.encoder._text_adapters(adapter, len(texts))
        with stage("tokenize"):
            encodings = self._tokenizer(max_length).encode_batch(texts) if texts else []
        lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
        dense = np.zeros((len(texts), self.encoder.config.hidden_size), dtype=np.float32) if return_dense else None
        lexical = [None] * len(texts) if return_sparse else None
        colbert = [None] * len(texts) if return_colbert_vecs else None
        if batch_tokens is None:
            order = np.argsort(-lengths, kind="stable")
            batches = [order[s:s + batch_size] for s in range(0, len(texts), batch_size)]
        else:
            batches = [np.array(rows) for rows in token_budget_batches(lengths.tolist(), batch_tokens)]
        workers, threads = plan(self.encoder.device, len(batches), workers, self.encoder.backend)

        def run(rows):
            width = int(lengths[rows[0]])
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, i in enumerate(rows):
                ids[r, :lengths[i]] = encodings[i].ids
                mask[r, :lengths[i]] = 1
            return rows, self.encode_tokens(torch.from_numpy(ids), torch.from_numpy(mask), return_dense=return_dense,
                                            return_sparse=return_sparse, return_colbert_vecs=return_colbert_vecs,
                                            adapter_ids=None if adapters is None else [adapters[i] for i in rows])

        # The results are gathered in NumPy: a torch op here would spin its OpenMP team on the workers' cores.
        results = ordered_map(run, batches, workers, threads)
        if show_progress_bar or (show_progress_bar is None and len(batches) >= 8):
            from tqdm.auto import tqdm

            results = tqdm(results, total=len(batches), desc="Batches", unit="batch",
                           disable=None if show_progress_bar is None else False)
        for rows, out in results:
            if return_dense:
                dense[rows] = out["dense_vecs"]
            for name, store in (("lexical_weights", lexical), ("colbert_vecs", colbert)):
                for i, value in zip(rows, out[name] or ()):
                    store[i] = value
        if single:
            return {"dense_vecs": None if dense is None else dense[0],
                    "lexical_weights": None if lexical is None else lexical[0],
                    "colbert_vecs": None if colbert is None else colbert[0]}
        return {"dense_vecs": dense, "lexical_weights": lexical, "colbert_vecs": colbert}

    def encode_tokens(self, input_ids, attention_mask, *, return_dense: bool = True, return_sparse: bool = True,
                      return_colbert_vecs: bool = False, normalize: bool | None = None, adapter_ids=None) -> dict:
        """One batch already tokenized ((N, S) int64, right padded, each row starting with CLS) -> `encode`'s dict for
        these rows: 'dense_vecs' (N, H) float32 NumPy, 'lexical_weights' [N dicts], 'colbert_vecs' [N (n_tokens - 1,
        D) float32 NumPy], None for an output not asked for. normalize, adapter_ids as `embed_tokens`."""
        d, w, v, cu = self.embed_tokens(input_ids, attention_mask, sparse=return_sparse, colbert=return_colbert_vecs,
                                        normalize=normalize, adapter_ids=adapter_ids)
        cu = cu.cpu().numpy()
        lexical = colbert = None
        if return_sparse:
            packed_ids = input_ids.cpu().numpy()[attention_mask.cpu().numpy().astype(bool)]
            lexical = lexical_weights(packed_ids, w.cpu().numpy(), cu, self.unused_ids)
        if return_colbert_vecs:
            colbert = np.split(v.cpu().numpy(), cu[1:-1] - np.arange(1, len(cu) - 1))
        return {"dense_vecs": d.cpu().numpy() if return_dense else None, "lexical_weights": lexical,
                "colbert_vecs": colbert}

    compute_lexical_matching_score = staticmethod(compute_lexical_matching_score)
    colbert_score = staticmethod(colbert_score)


__all__ = ["BGEM3", "check_heads", "colbert_score", "compute_lexical_matching_score", "is_bgem3_checkpoint",
           "lexical_weights", "read_head", "special_token_ids"]
