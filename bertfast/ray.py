"""`Embedder`: one engine that turns batches of texts into sentence embeddings, the unit a Ray actor holds.

Use it as the callable class of `ray.data.Dataset.map_batches`:

    ds = ray.data.read_parquet("corpus/")
    ds = ds.map_batches(bertfast.ray.Embedder, fn_constructor_kwargs=dict(model=path, dtype="int8"),
                        concurrency=4, batch_size=1024)

Each actor loads one engine and sets torch's threads to the CPUs Ray assigned it (`num_cpus`, 1 by
default); each batch's text column becomes an `embedding` column ((N, D) float32). The vectors equal
`Encoder.encode` on the same texts bit for bit (the engine is batch-invariant), whatever the batch
size or the number of actors. Importing this module does not import Ray; outside Ray the class is a
plain embedder (`bertfast embed` uses it in-process too).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

BATCH_TOKENS = 1024  # padded tokens per forward: on a CPU small batches keep activations in cache (docs/embed.md)
# ... and per forward of each worker thread where several share the cores (`bertfast embed`'s default), by dtype, as
# measured (docs/embed.md#worker-threads): int8 and fp32 at 1024, bf16 at 512.
WORKER_BATCH_TOKENS = {"int8": 1024, "float32": 1024, "bfloat16": 512}


def worker_batch_tokens(encoder) -> int:
    """The padded tokens per forward of each of several worker threads for this encoder's dtype."""
    return WORKER_BATCH_TOKENS.get(encoder.quantize or str(encoder.dtype).replace("torch.", ""), 512)


def _assigned_cpus() -> int | None:
    """The CPUs Ray assigned the calling actor, or None outside a Ray actor."""
    ray = sys.modules.get("ray")  # a Ray worker has imported ray; never import it here
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # the driver (or a task): leave its threads alone
        return None
    cpus = context.get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


class Embedder:
    """Texts -> (N, D) float32 embeddings with one engine; picklable by reference for Ray actors.

    model: a model directory (default: the embedded all-MiniLM-L6-v2); dtype, backend: as
    `Encoder.from_pretrained`; column / output_column: the batch's text column and the embedding column
    `__call__` adds; batch_tokens: the engine's token budget per forward; pooling, normalize, prompt_name,
    prompt, truncate_dim, workers: as `Encoder.encode` (workers split the threads); threads: torch threads
    (default: the CPUs Ray assigned this actor; outside Ray, unchanged); adapter: a PEFT LoRA directory every text
    runs through, as `Encoder.encode(texts, adapter=...)` after `load_adapter` (a LoadError names what does not fit).
    """

    ADAPTER = "adapter"  # the name `adapter` is loaded under

    def __init__(self, model: str | None = None, *, dtype=None, backend: str = "auto", column: str = "text",
                 output_column: str = "embedding", batch_tokens: int = BATCH_TOKENS, pooling=None,
                 normalize: bool | None = None, prompt_name: str | None = None, prompt: str | None = None,
                 truncate_dim: int | None = None, threads: int | None = None, workers: int | None = None,
                 adapter: str | None = None):
        from . import default_model_path
        from .encoder import Encoder
        from .loading import LoadError
        from .workers import plan

        assigned = _assigned_cpus()
        if assigned is not None:  # a Ray actor, a process of its own: BERTFAST_ISA's cap for the libraries too
            from .backends.cpu.isa import cap_libraries

            cap_libraries()
        threads = threads or assigned
        if threads:
            torch.set_num_threads(threads)
        self.encoder = Encoder.from_pretrained(model or default_model_path(), backend=backend, dtype=dtype)
        if adapter is not None:
            try:
                self.encoder.load_adapter(self.ADAPTER, adapter)
            except LoadError as e:  # a tensor's message alone does not say which directory it came from
                raise (e if str(adapter) in str(e) else LoadError(f"adapter {adapter}: {e}")) from None
        self.column, self.output_column = column, output_column
        self.options = dict(batch_tokens=batch_tokens, pooling=pooling, normalize=normalize,
                            prompt_name=prompt_name, prompt=prompt, truncate_dim=truncate_dim, workers=workers,
                            adapter=None if adapter is None else self.ADAPTER)
        self.dim = self.encoder.embedding_dim(pooling, truncate_dim)
        plan(self.encoder.device, 1, workers, self.encoder.backend)  # a bad value fails here, not at a batch
        self.encoder.sentence_config.resolve_prompt(prompt, prompt_name)  # a bad prompt name fails here
        # the tokenizer loads with the model (none fails here), not in each of the first batches at once
        self.encoder.tokenizer  # noqa: B018

    def embed(self, texts) -> tuple[np.ndarray, int]:
        """texts: a sequence of strings -> (embeddings (N, D) float32, real tokens the engine ran)."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"text {i} is {type(text).__name__}, not a string")
        emb = np.empty((len(texts), self.dim), dtype=np.float32)
        tokens = 0
        for rows, count, vectors in self.encoder.encode_batches(texts, **self.options):
            emb[rows] = vectors.cpu().numpy()
            tokens += count
        return emb, tokens

    def __call__(self, batch):
        """A Ray Data batch (dict of NumPy arrays, or a pandas DataFrame) with the text column ->
        the same batch with `output_column` added: (N, D) float32 (a list of rows for pandas)."""
        if self.column not in batch:
            raise ValueError(f"the batch has no column {self.column!r} (columns: {list(batch.keys())})")
        emb, _ = self.embed(batch[self.column].tolist())
        if isinstance(batch, dict):
            return {**batch, self.output_column: emb}
        batch[self.output_column] = list(emb)
        return batch


__all__ = ["Embedder"]
