"""SPLADE sparse embeddings: `SparseEncoder`, sentence-transformers' `SparseEncoder` on the bertfast engine.

A SparseEncoder checkpoint is a masked-LM model (`*ForMaskedLM`) followed by `SpladePooling`: modules.json lists
a Transformer with transformer_task "fill-mask" (or the legacy MLMTransformer), then SpladePooling. Here the
encoder runs on the engine, the MLM head's transform (dense, activation, LayerNorm) on the backend's ops, and the
vocabulary GEMM on the backend's `sparse_pool`, which reduces each sequence's log1p(relu(logits)) (max or sum over
its tokens) as it goes: the (tokens x vocab) logits are never held (cpu backend: in the GEMM's epilogue,
csrc/cpu/gemm/sparse_pool.cpp). A row's vector does not depend on its batch (cpu backend: bit for bit). The vocabulary
GEMM runs on the head's weights as loaded where the backend's `sparse_pool` takes that dtype (the cpu backend's bf16:
on AMX tiles where the tier has them, csrc/cpu/gemm/sparse_pool_amx.cpp), else fp32 (fp32 accumulation either way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters_heads import TaskAdapters, by_head
from .config import ConfigError, read_config_json
from .heads import load as load_task
from .kernels.activation import apply as activation
from .padding import unpad
from .sentence import read_json, resolve_prompt
from .tasks import TOKENS
from .workers import ordered_map, plan

POOLINGS = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")


@dataclass
class SpladeConfig:
    """What SpladePooling and config_sentence_transformers.json say: pooling strategy, activation, the default
    max_active_dims and the prompts (sentence-transformers' defaults where the checkpoint says nothing)."""

    pooling: str = "max"
    activation: str = "relu"
    max_active_dims: int | None = None
    prompts: dict = field(default_factory=lambda: {"query": "", "document": ""})
    default_prompt_name: str | None = None

    def __post_init__(self):
        if self.pooling not in POOLINGS:
            raise ConfigError(f"SpladePooling: pooling_strategy {self.pooling!r} is not one of {POOLINGS}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"SpladePooling: activation_function {self.activation!r} is not one of {ACTIVATIONS}")
        check_max_active_dims(self.max_active_dims, ConfigError)

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        return resolve_prompt(self.prompts, self.default_prompt_name, prompt, prompt_name)


def check_max_active_dims(value, error=ValueError) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise error(f"max_active_dims must be a positive integer or None, got {value!r}")


def _modules(directory: str) -> list[dict]:
    path = os.path.join(directory, "modules.json")
    if not os.path.isfile(path):
        return []
    modules = read_json(path, "SparseEncoder")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ConfigError("modules.json must be a list of {idx, name, path, type} objects")
    return sorted(modules, key=lambda m: m.get("idx", 0))


def is_sparse_checkpoint(directory: str) -> bool:
    """Whether `directory` is a sentence-transformers SparseEncoder with SPLADE pooling (its modules.json)."""
    return any(str(m["type"]).endswith("SpladePooling") for m in _modules(directory))


def read_splade_config(directory: str, vocab_size: int) -> SpladeConfig:
    """The SPLADE configuration of a SparseEncoder directory; ConfigError names a module stack it cannot run."""
    modules = _modules(directory)
    kinds = [str(m["type"]).rpartition(".")[2] for m in modules]
    if (len(kinds) != 2 or kinds[0] not in ("Transformer", "MLMTransformer") or kinds[1] != "SpladePooling"
            or os.path.normpath(modules[0].get("path") or ".") != "."):
        raise ConfigError(f"modules.json: bertfast's SparseEncoder runs a Transformer (fill-mask) in the model's own "
                          f"directory followed by SpladePooling; found {[m['type'] for m in modules]}")
    if kinds[0] == "Transformer":
        bert_config = read_json(os.path.join(directory, "sentence_bert_config.json"), "SparseEncoder", False)
        task = bert_config.get("transformer_task")
        if task != "fill-mask":
            raise ConfigError(f"sentence_bert_config.json: transformer_task is {task!r}; SPLADE needs 'fill-mask' "
                              "(the masked-LM logits)")
    pooling = read_json(os.path.join(directory, modules[1].get("path") or "", "config.json"), "SparseEncoder")
    dim = pooling.get("embedding_dimension", pooling.get("word_embedding_dimension"))
    if dim is not None and dim != vocab_size:
        raise ConfigError(f"SpladePooling: embedding_dimension {dim} is not the vocabulary size {vocab_size}")
    st = read_json(os.path.join(directory, "config_sentence_transformers.json"), "SparseEncoder", False)
    prompts = st.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ConfigError(f"config_sentence_transformers.json: 'prompts' must map names to strings, got {prompts!r}")
    return SpladeConfig(pooling.get("pooling_strategy", "max"), pooling.get("activation_function", "relu"),
                        st.get("max_active_dims"), {"query": "", "document": "", **prompts},
                        st.get("default_prompt_name"))


def top_k(dense: torch.Tensor, k: int | None) -> torch.Tensor:
    """The k largest values of each row kept, the rest zeroed (sentence-transformers' select_max_active_dims:
    top k by absolute value; SPLADE's values are >= 0). dense: (N, V)."""
    if k is None or k >= dense.shape[-1]:
        return dense
    values, indices = torch.topk(dense.abs(), k, dim=-1)
    return torch.zeros_like(dense).scatter_(-1, indices, dense.gather(-1, indices))


class VocabHead:
    """An MLM head as the SparseEncoder runs it: the transform's steps on the backend's ops (("linear", packed
    weight, bias, act) | ("layernorm", weight, bias) | ("act", id)), then the packed vocabulary projection and its
    bias. `base`: the base model's, whose packed projection an adapter's head shares when it left it alone."""

    def __init__(self, head, backend, architecture: str, vocab_size: int, base: "VocabHead | None" = None):
        source, steps = head.branches["logits"]
        if source != TOKENS or steps[-1][0] != "linear" or steps[-1][1].shape[0] != vocab_size:
            raise ConfigError(f"{architecture}: its head does not end in a vocabulary projection")
        self.transform = []
        for i, step in enumerate(steps[:-1]):
            if step[0] == "linear":
                fused = i + 1 < len(steps) - 1 and steps[i + 1][0] == "act"
                act = (steps[i + 1][1] or "none") if fused else "none"
                self.transform.append(("linear", backend.pack(step[1]), step[2], act))
            elif step[0] == "layernorm":
                bias = step[2] if step[2] is not None else torch.zeros_like(step[1])
                self.transform.append(("layernorm", step[1], bias))
            elif step[0] == "act" and (i == 0 or steps[i - 1][0] != "linear"):
                self.transform.append(("act", step[1] or "none"))
        weight, bias = steps[-1][1], steps[-1][2]
        self.weight = weight
        if base is not None and weight is base.weight:
            self.decoder = base.decoder
        else:
            vocab_dtype = weight.dtype if weight.dtype in backend.sparse_pool_dtypes else torch.float32
            self.decoder = backend.pack(weight.to(vocab_dtype).contiguous())
        self.decoder_bias = None if bias is None else bias.float().contiguous()


class SparseEncoder(TaskAdapters, nn.Module):
    """SPLADE on bertfast: `encode(texts)` -> (N, vocab) sparse vectors, as sentence-transformers'
    `SparseEncoder.encode` returns them. Build it with `from_pretrained(dir)` or `from_sentence_transformers(model)`.
    LoRA adapters (`load_adapter`, as `TaskModel`'s): the encoder's per row, and an adapter's LoRA or modules_to_save
    on the MLM head's transform or vocabulary as that adapter's own copy of the head (the base's tensors shared).
    """

    def __init__(self, task_model, config: SpladeConfig):
        super().__init__()
        self.encoder, self.splade = task_model.encoder, config
        self.head, self.architecture = task_model.head, task_model.architecture
        self.backend = self.encoder.engine.backend
        self.eps = task_model.head.eps
        self._adapter_heads: dict = {}  # adapter name -> its Head (TaskAdapters)
        self._vocab_heads: dict[str, VocabHead] = {}  # adapter name -> its head packed
        self._vocab = VocabHead(self.head, self.backend, self.architecture, self.vocab_size)

    def load_adapter(self, name: str, path) -> None:
        """Load the PEFT LoRA directory `path` under `name` (`TaskModel.load_adapter`: the encoder's factors, and
        the MLM head's LoRA or modules_to_save as this adapter's head, packed beside the base's)."""
        super().load_adapter(name, path)
        head = self._adapter_heads.get(name)
        if head is not None:
            try:
                self._vocab_heads[name] = VocabHead(head, self.backend, self.architecture, self.vocab_size, self._vocab)
            except BaseException:
                super().unload_adapter(name)
                raise

    def unload_adapter(self, name: str) -> None:
        """Forget `name` and its head; raises as `Encoder.unload_adapter`."""
        super().unload_adapter(name)
        self._vocab_heads.pop(name, None)

    @classmethod
    def from_pretrained(cls, path, *, backend: str = "auto", dtype=None):
        """A SparseEncoder directory as sentence-transformers saves it (modules.json, the *ForMaskedLM checkpoint,
        SpladePooling's config). dtype as `Encoder.from_pretrained` (None, "auto", torch.bfloat16, "int8"): the
        encoder's; the vocabulary GEMM is bf16 under bf16 on the cpu backend, fp32 otherwise."""
        path = os.fspath(path)
        d = read_config_json(path)
        arch = (d.get("architectures") or [None])[0]
        if not (arch or "").endswith("ForMaskedLM"):
            raise ConfigError(f"{path}: config.json's architecture is {arch!r}; SPLADE needs a *ForMaskedLM model")
        config = read_splade_config(path, d["vocab_size"])
        return cls(load_task(path, backend=backend, dtype=dtype, architecture=arch), config)

    @classmethod
    def from_sentence_transformers(cls, model, *, backend: str = "auto", dtype=None):
        """An in-memory `sentence_transformers.SparseEncoder` (Transformer over a *ForMaskedLM model, then
        SpladePooling): its weights, tokenizer (with its max_seq_length), prompts and max_active_dims."""
        from tokenizers import Tokenizer

        kinds = [type(m).__name__ for m in model]
        hf = getattr(model[0], "auto_model", None) if len(kinds) == 2 else None
        if hf is None or kinds[1] != "SpladePooling" or not type(hf).__name__.endswith("ForMaskedLM"):
            raise ConfigError(f"bertfast's SparseEncoder runs a Transformer over a *ForMaskedLM model followed by "
                              f"SpladePooling; this model has {kinds}")
        pool = model[1]
        config = SpladeConfig(pool.pooling_strategy, pool.activation_function, model.max_active_dims,
                              dict(model.prompts), model.default_prompt_name)
        out = cls(load_task(hf, backend=backend, dtype=dtype), config)
        tok = Tokenizer.from_str(model.tokenizer.backend_tokenizer.to_str())
        tok.enable_truncation(max_length=model.max_seq_length)
        tok.enable_padding(pad_id=model.tokenizer.pad_token_id or 0, pad_token=model.tokenizer.pad_token or "[PAD]")
        out.encoder._tokenizer = tok
        return out

    @property
    def vocab_size(self) -> int:
        return self.encoder.config.vocab_size

    def extra_repr(self):
        return (f"pooling={self.splade.pooling!r}, activation={self.splade.activation!r}, "
                f"max_active_dims={self.splade.max_active_dims}, backend={self.encoder.backend!r}")

    @torch.inference_mode()
    def embed_tokens(self, input_ids, attention_mask, token_type_ids=None, adapter_ids=None) -> torch.Tensor:
        """Texts already tokenized -> (N, vocab) fp32 dense SPLADE vectors (no top-k). input_ids, attention_mask,
        token_type_ids: (N, S) integer (token_type_ids None: zeros); adapter_ids: as `Encoder.forward`'s. A row's
        vector depends on that row and its adapter alone."""
        types = token_type_ids if self.encoder.config.type_vocab_size else None
        last = self.encoder._run(input_ids, attention_mask, types, None, False, pool=False,
                                 adapter_ids=adapter_ids)[0]
        mask = attention_mask.to(last.device)
        heads = self._row_heads(adapter_ids, last.shape[0])  # None: no adapter (nor default) on any row
        if heads is None:
            return self._pooled(self._vocab, last, mask)
        packed = {id(self.head): self._vocab, **{id(self._adapter_heads[n]): v for n, v in self._vocab_heads.items()}}
        return by_head([packed[id(h)] for h in heads], lambda head, idx: self._pooled(
            head, last if idx is None else last[idx], mask if idx is None else mask[idx]), last.device)

    def _pooled(self, head: VocabHead, last: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x, _, cu_seqlens, _ = unpad(last, mask)
        for step in head.transform:
            if step[0] == "linear":
                x = self.backend.linear(x, step[1], step[2], step[3])
            elif step[0] == "layernorm":
                x = self.backend.layernorm(x, step[1], step[2], self.eps)
            else:
                x = activation(x, step[1])
        return self.backend.sparse_pool(x, head.decoder, head.decoder_bias, cu_seqlens, self.splade.pooling,
                                        self.splade.activation)

    def encode(self, texts, *, prompt_name: str | None = None, prompt: str | None = None, batch_size: int = 32,
               max_active_dims: int | None = None, convert_to_tensor: bool = True,
               convert_to_sparse_tensor: bool = True, show_progress_bar: bool | None = None, adapter=None,
               workers: int | None = None):
        """Sparse embeddings as sentence-transformers' `SparseEncoder.encode` makes them: texts (a string or a list)
        -> a (N, vocab) torch sparse COO tensor (one string: (vocab,)); convert_to_sparse_tensor=False: dense;
        convert_to_tensor=False: a list of 1-D tensors. max_active_dims keeps each vector's largest values (None:
        the checkpoint's max_active_dims, if any). prompt / prompt_name prepend a prompt, as sentence-transformers.
        adapter: a LoRA adapter's name (`load_adapter`) for every text, or one name or None per text (None:
        `default_adapter`). Batches of batch_size texts, longest first; a vector does not depend on its batch.
        workers: threads that each run their own batches on a share of the cores, as `Encoder.encode`'s
        (`bertfast.workers`; None: one per torch thread, on the cpu backend); the same bits whatever the workers."""
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_max_active_dims(max_active_dims)
        adapters = self.encoder._text_adapters(adapter, len(texts))
        k = max_active_dims if max_active_dims is not None else self.splade.max_active_dims
        prefix = self.splade.resolve_prompt(prompt, prompt_name)
        if prefix:
            texts = [prefix + t for t in texts]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        starts = range(0, len(texts), batch_size)
        workers, threads = plan(self.encoder.device, len(starts), workers, self.encoder.backend)

        def run(start):
            """A batch's rows, and per row its (columns, values), columns ascending (or the dense rows)."""
            group = order[start:start + batch_size]
            vectors = top_k(self.embed_tokens(*self.encoder.tokenize([texts[i] for i in group]),
                                              adapter_ids=None if adapters is None else [adapters[i] for i in group]),
                            k)
            if not convert_to_sparse_tensor:
                return group, vectors
            r, c = vectors.nonzero(as_tuple=True)  # row-major: each row's columns ascending
            counts = torch.bincount(r, minlength=len(group)).tolist()
            return group, list(zip(c.split(counts), vectors[r, c].split(counts)))

        results = ordered_map(run, starts, workers, threads)
        if show_progress_bar:
            from tqdm.auto import tqdm

            results = tqdm(results, total=len(starts), desc="Batches", unit="batch")
        pieces, dense = [None] * len(texts), []  # pieces[i]: text i's (columns, values), columns ascending
        for group, got in results:
            if convert_to_sparse_tensor:
                for i, piece in zip(group, got):
                    pieces[i] = piece
            else:
                dense.append((group, got))
        if convert_to_sparse_tensor:
            # Rows in text order, columns ascending in each: coalesced as built (coalesce() sorted them again: a
            # quarter of a dense-ish encode's time).
            device = pieces[0][0].device if pieces else torch.device("cpu")
            counts = torch.tensor([len(p[0]) for p in pieces], dtype=torch.int64, device=device)
            rows = torch.repeat_interleave(torch.arange(len(texts), device=device), counts)
            cols = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.int64)
            vals = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0)
            out = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, (len(texts), self.vocab_size),
                                          check_invariants=False, is_coalesced=True)
        else:
            out = torch.zeros(len(texts), self.vocab_size)
            for group, vectors in dense:
                out[torch.tensor(group)] = vectors.to(out.device)
        if single:
            return out[0]
        return out if convert_to_tensor else list(out.unbind(0))

    def encode_query(self, texts, **kwargs):
        """`encode` with the "query" prompt unless a prompt is given (sentence-transformers' encode_query)."""
        if kwargs.get("prompt") is None and kwargs.get("prompt_name") is None and "query" in self.splade.prompts:
            kwargs["prompt_name"] = "query"
        return self.encode(texts, **kwargs)

    def encode_document(self, texts, **kwargs):
        """`encode` with the "document" prompt unless a prompt is given (sentence-transformers' encode_document)."""
        if kwargs.get("prompt") is None and kwargs.get("prompt_name") is None and "document" in self.splade.prompts:
            kwargs["prompt_name"] = "document"
        return self.encode(texts, **kwargs)


__all__ = ["SparseEncoder", "SpladeConfig", "is_sparse_checkpoint", "read_splade_config", "top_k"]
