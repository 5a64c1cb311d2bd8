"""The service behind the routes: the served models by name, each an `Engine` (the `ServedModel`, its `Batcher` on
an engine thread of its own, its limits), and what every model route does with one: check the model's kind, count
the inputs, admit the request or refuse it at once (429 when its places are taken, 503 at shutdown), tokenize (short
texts on the event loop: a thread hop costs more than tokenizing them; longer ones on a worker thread), queue the
rows and await the engine thread's result. A request may name one of its model's LoRA adapters (TEI's `adapter`
field, OpenAI's `"model": "MODEL:ADAPTER"`); its rows carry the name to the engine thread, where they share batches
with rows of other adapters and of the base model. Adapters load and unload at run time (`Engine.load_adapter`,
`unload_adapter`) on the engine thread between batches; an unloaded adapter is refused to new requests at once and
leaves the model only once the requests that hold it are answered. The event loop never runs a model; an error raised
at any step leaves nothing queued or held (admission is a context manager, rows are queued only once every input is
checked).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from bertfast.precision import quantize_embeddings

from .batcher import Batcher, Busy, Closed, Job
from .metrics import Metrics
from .model import LOGITS, MULTI, ROUTES, SCORES, ServedModel
from .schemas import ApiError, Info, OpenAIError

# What a model route needs, for the 424 a model of another kind answers.
NEEDS = {"/embed": "an embedding model or BGE-M3 (its dense vectors)", "/v1/embeddings": "an embedding model",
         "/embed_all": "an embedding model (per-token states: not a SPLADE model or a classifier)",
         "/predict": "a sequence classifier or a reranker (architecture *ForSequenceClassification)",
         "/rerank": "a reranker: a cross-encoder, i.e. a sequence classifier with one label",
         "/embed_sparse": "a SPLADE model (a sentence-transformers SparseEncoder: a masked-LM head and SpladePooling) "
                          "or BGE-M3 (its lexical weights)",
         "/embed_multi": "a ColBERT model (PyLate: modules.json a Transformer then Dense projections) or BGE-M3 "
                         "(sparse_linear.pt and colbert_linear.pt beside the model)",
         "/similarity": "an embedding model or BGE-M3 (the cosine of its dense vectors)"}
# Routes that answer wherever another does (the one `ROUTES` names): TEI's aliases and /similarity (over /embed's
# vectors).
SAME_AS = {"/embeddings": "/v1/embeddings", "/similarity": "/embed"}
# Requests whose texts hold at most this many characters are tokenized on the event loop (tens of
# microseconds); a worker thread's round trip costs more than that.
INLINE_TOKENIZE_CHARS = 1024
# How often an unload looks whether the requests holding its adapter are answered.
UNLOAD_POLL_SECONDS = 0.005


@dataclass
class Limits:
    max_batch_tokens: int = 16384
    max_concurrent_requests: int = 512
    max_client_batch_size: int = 32
    max_body_bytes: int = 2_000_000


async def off_loop(tokenize, texts: list, **kwargs):
    """tokenize(texts, **kwargs), on a worker thread unless the texts are short."""
    chars = sum(len(t) if isinstance(t, str) else sum(map(len, t)) for t in texts)
    if chars <= INLINE_TOKENIZE_CHARS:
        return tokenize(texts, **kwargs)
    return await run_in_threadpool(tokenize, texts, **kwargs)


class Engine:
    """One served model: its engine thread (a Batcher with the model's own token budget and request places) and the
    steps of a request to it."""

    def __init__(self, model: ServedModel, limits: Limits, metrics: Metrics, ranges=None):
        self.model, self.limits, self.ranges = model, limits, ranges
        self.batcher = Batcher(limits.max_batch_tokens, limits.max_concurrent_requests)
        metrics.add_model(model.model_id, self.batcher)
        self.info: dict | None = None  # /info's body, once loaded
        # Adapters requests may name (insertion order: /v1/models'), changed on the event loop only, as `users`.
        self.live: dict[str, None] = {}
        self.users: dict[str, int] = {}  # requests in flight per adapter
        self.changing: set[str] = set()  # names being loaded or unloaded

    @property
    def name(self) -> str:
        return self.model.model_id

    async def start(self) -> None:
        await asyncio.wrap_future(self.batcher.start(self.model.load))  # a load error stops the server
        self.info = Info(**self.model.info(), **vars(self.limits)).model_dump()
        self.live = dict.fromkeys(self.model.adapters)

    def serves(self, route: str) -> None:
        """424 unless this model's kind answers `route`."""
        model = self.model
        if SAME_AS.get(route, route) not in ROUTES[model.kind]:
            raise ApiError(424, f"this model is {model.description()}: {route} needs "
                           f"{NEEDS.get(route) or NEEDS[SAME_AS[route]]}; "
                           f"this server answers {', '.join(ROUTES[model.kind])}", "model_type")

    def texts_of(self, inputs, field: str) -> list[str]:
        """`inputs` (a string or a list of them) as a list: not empty, within --max-client-batch-size, no empty
        string (4xx naming the field)."""
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not texts:
            raise ApiError(422, f"{field} is empty: send at least one text", field=field)
        self.check_count(len(texts), field)
        for i, t in enumerate(texts):
            if not t:
                raise ApiError(422, f"{field}[{i}] is an empty string", field=f"{field}[{i}]")
        return texts

    def check_count(self, n: int, field: str) -> None:
        limit = self.limits.max_client_batch_size
        if n > limit:
            raise ApiError(413, f"{field} has {n} items, more than the limit of {limit} (--max-client-batch-size)",
                           field=field, limit=limit)

    def check_dimensions(self, dims: int | None) -> None:
        """422 unless `dimensions` is None or in [1, the model's dimension]."""
        limit = self.model.dimension
        if dims is not None and not 1 <= dims <= limit:
            raise ApiError(422, f"dimensions must be in [1, {limit}] (the model's dimension), got {dims}",
                           field="dimensions", limit=limit)

    @asynccontextmanager
    async def admitted(self, adapter: str | None = None, *, openai: bool = False):
        """Hold one of the model's request places for the block (429 at once when none is free), and the adapter
        `adapter` if given (404 as `adapter()` when it is gone: an unload waits until no request holds it)."""
        try:
            with self.batcher.admit():
                self.adapter(adapter, openai=openai)
                if adapter is None:
                    yield
                    return
                self.users[adapter] = self.users.get(adapter, 0) + 1
                try:
                    yield
                finally:
                    self.users[adapter] -= 1
        except Busy as e:
            raise ApiError(429, f"{e}: retry later", "overloaded",
                           limit=self.limits.max_concurrent_requests) from None
        except Closed as e:
            raise ApiError(503, str(e), "unavailable") from None

    def adapter(self, name: str | None, *, openai: bool = False) -> str | None:
        """`name` if it names one of this model's adapters (None: the base model); 404 otherwise, in OpenAI's error
        shape on the /v1 routes (`openai`, the adapter named in `model`), in the server's own elsewhere (field
        `adapter`)."""
        if name is None or name in self.live:
            return name
        loaded = ", ".join(self.live) or "none"
        message = (f"the model {self.name!r} has no adapter {name!r}: its adapters are {loaded} "
                   "(GET /v1/models lists them as MODEL:ADAPTER)")
        if openai:
            error = OpenAIError(404, message, "invalid_request_error", param="model", code="model_not_found")
        else:
            error = ApiError(404, message, "adapter_not_found", field="adapter")
        raise error

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the PEFT LoRA directory `path` as adapter `name`, on the engine thread between two batches; requests
        may name it once this returns. 409 for a name loaded or changing, 422 naming what does not fit
        (`ServedModel.load_adapter`'s LoadError: a tensor, a shape, a head's num_labels). Call it admitted."""
        model = self.model
        if not name or ":" in name:
            raise ApiError(422, f"name must be a non-empty string without ':' (MODEL:ADAPTER names it), got {name!r}",
                           field="name")
        if name in self.live or name in self.changing:
            raise ApiError(409, f"the model {self.name!r} already has an adapter named {name!r} (or one is being "
                           "loaded or unloaded): unload it first", "conflict", field="name")
        self.changing.add(name)
        try:
            await self.on_engine(partial(model.load_adapter, name, path))
        except (ValueError, NotImplementedError) as e:  # LoadError is a ValueError; so is a bad name
            raise ApiError(422, f"adapter {name!r}: {e}", "adapter_load", field="path") from None
        finally:
            self.changing.discard(name)
        self.live[name] = None

    async def unload_adapter(self, name: str) -> None:
        """Refuse adapter `name` to new requests at once (404), wait until no request holds it, then unload it on the
        engine thread; 404 if it is not loaded. Call it admitted."""
        self.adapter(name)
        del self.live[name]
        self.changing.add(name)
        try:
            while self.users.get(name):
                await asyncio.sleep(UNLOAD_POLL_SECONDS)
            await self.on_engine(partial(self.model.unload_adapter, name))
        finally:
            self.changing.discard(name)

    async def on_engine(self, fn):
        """fn() run on the engine thread between two batches (`Batcher.call`); 503 once it has stopped."""
        try:
            return await asyncio.wrap_future(self.batcher.call(fn))
        except Closed as e:
            raise ApiError(503, str(e), "unavailable") from None

    async def run_rows(self, rows: list[list[int]], key: tuple, types: list[list[int]] | None = None,
                       min_tokens: int = 0, adapter: str | None = None):
        """Rows of token ids -> the engine thread's result for them (see `ServedModel.run`); min_tokens: each row's
        least cost in the batch budget (`Job`); adapter: the LoRA adapter the rows run with (None: the base model)."""
        try:
            job = Job(rows, key, types, min_tokens=min_tokens, adapter=adapter)
            return await asyncio.wrap_future(self.batcher.submit(job))
        except Closed as e:
            raise ApiError(503, str(e), "unavailable") from None

    async def text_rows(self, texts, *, truncate=False, direction="right", prompt_name=None, field="inputs"):
        """Texts -> (token id rows, the prompt's token count or None), the model's prompt prepended."""
        prompt, prompt_len = self.model.prompt(prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        rows = await off_loop(self.model.text_ids, texts, truncate=truncate, direction=direction, field=field)
        return rows, prompt_len

    async def multi_vectors(self, texts: list[str], *, is_query: bool | None, truncate: bool, prompt_name=None,
                            field: str = "inputs", adapter: str | None = None) -> list[np.ndarray]:
        """Texts -> each text's (tokens, dim) float32 token vectors from the engine thread (/embed_multi): the model's
        prompt prepended, its own tokenization (`ServedModel.multi_rows`), the LoRA adapter `adapter` (None: the base
        model); 422 for a ColBERT model without is_query."""
        model = self.model
        if model.colbert is not None and is_query is None:
            raise ApiError(422, "is_query is required for a ColBERT model: true for queries (the query prefix, "
                           "expanded to query_length), false for documents", field="is_query")
        prompt, _ = model.prompt(prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        rows = await off_loop(model.multi_rows, texts, is_query=is_query, truncate=truncate, field=field)
        is_query = None if model.colbert is None else is_query  # BGE-M3 encodes queries and documents alike
        return await self.run_rows(rows, (MULTI, is_query), min_tokens=model.min_tokens(is_query), adapter=adapter)

    async def scores_of(self, inputs: list, *, raw: bool, truncate: bool, direction: str, field: str,
                        adapter: str | None = None) -> np.ndarray:
        """Texts and pairs -> (len(inputs), labels) probabilities, or logits when raw, from the engine thread, with the
        LoRA adapter `adapter` (its head where it saved one; None: the base model)."""
        encodings = await off_loop(self.model.tokenize, inputs, truncate=truncate, direction=direction, field=field)
        return await self.run_rows([e.ids for e in encodings], LOGITS if raw else SCORES,
                                   [e.type_ids for e in encodings], adapter=adapter)

    def quantized(self, vectors: np.ndarray, precision: str) -> np.ndarray:
        """The vectors in `precision`: float64-widened float32, or the quantized codes (each row on its own: no
        range is taken from the request's other texts)."""
        ranges = self.ranges
        if precision == "float32":
            return vectors.astype(np.float64)
        if precision in ("int8", "uint8"):
            if ranges is None:
                raise ApiError(422, f"precision {precision} needs the server started with --ranges FILE.npy (the "
                               "corpus's per-dimension minimum and maximum, as bertfast.quantization_ranges "
                               "computes them): a range taken from one request would make a text's codes depend "
                               "on the others", field="precision")
            if ranges.shape[1] != vectors.shape[1]:
                raise ApiError(422, f"precision {precision}: the server's --ranges are for {ranges.shape[1]} "
                               f"dimensions, these vectors have {vectors.shape[1]}", field="precision")
        return quantize_embeddings(vectors, precision, ranges)


class Service:
    """The served models, by name (`ServedModel.model_id`); the first is the default. A request names its model in
    its `model` field: with one model served the field is not checked (OpenAI clients send names of their own, as
    TEI ignores it); with several an unknown name is a 404 listing the served ones."""

    def __init__(self, models: list[ServedModel], limits: Limits | list[Limits] = Limits(), ranges=None,
                 adapter_root: str | None = None):
        if not models:
            raise ValueError("a server needs at least one model")
        per_model = list(limits) if isinstance(limits, (list, tuple)) else [limits] * len(models)
        if len(per_model) != len(models):
            raise ValueError(f"{len(models)} models and {len(per_model)} Limits: give one, or one per model")
        names = [m.model_id for m in models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"two models are named {twice[0]!r}: give each a name of its own (--model NAME=DIR)")
        self.limits = per_model[0]  # the server-wide ones (body size) come from the first model's
        self.metrics = Metrics(self)
        self.engines = {m.model_id: Engine(m, lim, self.metrics, ranges) for m, lim in zip(models, per_model)}
        self.default = self.engines[names[0]]
        self.created = int(time.time())
        self.adapter_root = adapter_root  # where the admin route loads adapters from (None: it is off)

    def engine(self, name: str | None, *, openai: bool = False) -> Engine:
        """The engine serving `name` (None: the default); 404 for an unknown name, in OpenAI's error shape on the
        /v1 routes (`openai`), in the server's own elsewhere."""
        if name is None or len(self.engines) == 1:
            return self.default
        engine = self.engines.get(name)
        if engine is None:
            raise self.unknown(name, openai)
        return engine

    def openai_model(self, name: str | None) -> tuple[Engine, str | None]:
        """OpenAI's `model` -> (its engine, the adapter it names or None). A served model's exact name is that model;
        else "MODEL:ADAPTER" (split at the last ':') is MODEL's adapter ADAPTER, MODEL resolved as `engine` resolves
        it; an adapter the model lacks is a 404 in OpenAI's shape."""
        if name is None or name in self.engines:
            return self.engine(name, openai=True), None
        base, sep, adapter = name.rpartition(":")
        if not sep or not adapter:
            return self.engine(name, openai=True), None
        engine = self.engine(base, openai=True)
        return engine, engine.adapter(adapter, openai=True)

    def names(self) -> list[str]:
        """Every name /v1/models lists: each model, then its adapters as MODEL:ADAPTER."""
        return [n for name, e in self.engines.items() for n in (name, *(f"{name}:{a}" for a in e.live))]

    def unknown(self, name: str, openai: bool = False) -> ApiError:
        """The 404 of a model not served here."""
        served = ", ".join(self.engines)
        message = f"the model {name!r} is not served here: this server serves {served} (GET /v1/models)"
        if openai:
            return OpenAIError(404, message, "invalid_request_error", param="model", code="model_not_found")
        return ApiError(404, message, "model_not_found", field="model")

    async def start(self) -> None:
        """Load every model, each on its engine thread, at once."""
        await asyncio.gather(*(e.start() for e in self.engines.values()))

    def close(self) -> None:
        """Refuse new requests, answer every admitted one, stop every engine thread (blocking)."""
        for engine in self.engines.values():
            engine.batcher.close(wait=False)  # every model stops admitting first
        for engine in self.engines.values():
            engine.batcher.close()

    @property
    def alive(self) -> bool:
        return all(e.batcher.alive for e in self.engines.values())

    @property
    def depth(self) -> int:
        return sum(e.batcher.depth for e in self.engines.values())

    @property
    def accepted(self) -> int:
        return sum(e.batcher.accepted for e in self.engines.values())


def service_of(request: Request) -> Service:
    """The app's Service (a FastAPI dependency of every route)."""
    return request.app.state.service
