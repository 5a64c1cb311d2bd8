"""The server's routes: TEI-compatible (/embed, /embed_sparse, /predict, /rerank, /tokenize, /info, /health,
/metrics) and OpenAI-compatible (/v1/embeddings).

A route validates (schemas, then limits: 4xx JSON naming the field and the limit), is admitted or
refused at once (429 when `max_concurrent_requests` are in flight, 503 at shutdown), tokenizes (short
texts on the event loop: a thread hop costs more than tokenizing them; longer ones on a worker
thread), and waits for the engine thread's result: the event loop never runs the model. Responses are
serialized by orjson (the float32 results widened to float64 first: the same numbers `tolist()` gives,
an order of magnitude faster than `json.dumps`). The
model routes answer the kind of model loaded (`model.ROUTES`); the others answer 424 naming what the
model is, as TEI does ("model is not a classifier model").
"""

from __future__ import annotations

import asyncio
import base64
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Union

import numpy as np
import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from bertfast.precision import quantize_embeddings

from .batcher import Batcher, Busy, Closed, Job
from .gate import Gate
from .metrics import Metrics
from .model import LOGITS, ROUTES, SCORES, SPLADE, ServedModel
from .schemas import (ApiError, EmbedRequest, EmbedSparseRequest, ErrorBody, Info, OpenAIEmbeddingRequest,
                      OpenAIEmbeddingResponse, Prediction, PredictRequest, Rank, RerankRequest, SparseValue, Token,
                      TokenizeRequest)

SCHEMAS = {"/embed": EmbedRequest, "/embed_sparse": EmbedSparseRequest, "/tokenize": TokenizeRequest,
           "/v1/embeddings": OpenAIEmbeddingRequest,
           "/predict": PredictRequest, "/rerank": RerankRequest}
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 405, 413, 422, 424, 429, 503)}
# What a model route needs, for the 424 a model of another kind answers.
NEEDS = {"/embed": "an embedding model", "/v1/embeddings": "an embedding model",
         "/predict": "a sequence classifier or a reranker (architecture *ForSequenceClassification)",
         "/rerank": "a reranker: a cross-encoder, i.e. a sequence classifier with one label",
         "/embed_sparse": "a SPLADE model (a sentence-transformers SparseEncoder: a masked-LM head and SpladePooling)"}
# Requests whose texts hold at most this many characters are tokenized on the event loop (tens of
# microseconds); a worker thread's round trip costs more than that.
INLINE_TOKENIZE_CHARS = 1024


def json_response(content) -> Response:
    """A JSON response by orjson; numpy arrays inside are written as lists (float64: pass them widened)."""
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


async def off_loop(tokenize, texts: list, **kwargs):
    """tokenize(texts, **kwargs), on a worker thread unless the texts are short."""
    chars = sum(len(t) if isinstance(t, str) else sum(map(len, t)) for t in texts)
    if chars <= INLINE_TOKENIZE_CHARS:
        return tokenize(texts, **kwargs)
    return await run_in_threadpool(tokenize, texts, **kwargs)


@dataclass
class Limits:
    max_batch_tokens: int = 16384
    max_concurrent_requests: int = 512
    max_client_batch_size: int = 32
    max_body_bytes: int = 2_000_000


def internal_error(e: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal")


def direct_route(schema, handler):
    """The Gate's direct path for a route: body -> handler(schema) -> its Response (errors the handler
    raises included), or None when the body does not fit the schema (the FastAPI app then answers, with
    the error it writes for that body)."""

    async def answer(body: bytes) -> Response | None:
        try:
            req = schema.model_validate_json(body)
        except ValidationError:
            return None
        try:
            return await handler(req)
        except ApiError as e:
            return e.response()
        except Exception as e:  # noqa: BLE001  as the app's handler of last resort does
            return internal_error(e).response()

    return answer


def create_app(model: ServedModel, limits: Limits = Limits(), api_key: str | None = None, ranges=None) -> Gate:
    """The server's ASGI app: the Gate in front of the FastAPI app (which serves /openapi.json). ranges: the (2, D)
    int8/uint8 quantization ranges (--ranges), or None (those precisions are refused)."""
    batcher = Batcher(limits.max_batch_tokens, limits.max_concurrent_requests)
    metrics = Metrics(batcher)
    batcher.on_batch = metrics.on_batch
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.wrap_future(batcher.start(model.load))  # a load error stops the server here
        state["info"] = Info(**model.info(), **vars(limits)).model_dump()
        yield
        await run_in_threadpool(batcher.close)  # uvicorn has answered every request by now

    app = FastAPI(title="bertfast serve", version="0.1.0", lifespan=lifespan, responses=ERRORS,
                  description="Sentence embeddings from a BERT-family encoder, batched on one engine thread.")
    install_error_handlers(app)

    def serves(route: str) -> None:
        if route not in ROUTES[model.kind]:
            raise ApiError(424, f"this model is {model.description()}: {route} needs {NEEDS[route]}; "
                           f"this server answers {', '.join(ROUTES[model.kind])}", "model_type")

    def texts_of(inputs, field: str) -> list[str]:
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if not texts:
            raise ApiError(422, f"{field} is empty: send at least one text", field=field)
        if len(texts) > limits.max_client_batch_size:
            raise ApiError(413, f"{field} has {len(texts)} items, more than the limit of "
                           f"{limits.max_client_batch_size} (--max-client-batch-size)",
                           field=field, limit=limits.max_client_batch_size)
        for i, t in enumerate(texts):
            if not t:
                raise ApiError(422, f"{field}[{i}] is an empty string", field=f"{field}[{i}]")
        return texts

    async def run_rows(rows: list[list[int]], key: tuple, types: list[list[int]] | None = None) -> np.ndarray:
        try:
            return await asyncio.wrap_future(batcher.submit(Job(rows, key, types)))
        except Closed as e:
            raise ApiError(503, str(e), "unavailable") from None

    async def scores_of(inputs: list, *, raw: bool, truncate: bool, direction: str, field: str) -> np.ndarray:
        """Texts and pairs -> (len(inputs), labels) probabilities, or logits when raw, from the engine thread."""
        encodings = await off_loop(model.tokenize, inputs, truncate=truncate, direction=direction, field=field)
        return await run_rows([e.ids for e in encodings], LOGITS if raw else SCORES, [e.type_ids for e in encodings])

    @asynccontextmanager
    async def admitted():
        try:
            with batcher.admit():
                yield
        except Busy as e:
            raise ApiError(429, f"{e}: retry later", "overloaded", limit=limits.max_concurrent_requests) from None
        except Closed as e:
            raise ApiError(503, str(e), "unavailable") from None

    async def text_rows(texts, *, truncate=False, direction="right", prompt_name=None, field="inputs"):
        prompt, prompt_len = model.prompt(prompt_name)
        if prompt:
            texts = [prompt + t for t in texts]
        encodings = await off_loop(model.tokenize, texts, truncate=truncate, direction=direction, field=field)
        return [e.ids for e in encodings], prompt_len

    def quantized(vectors: np.ndarray, precision: str) -> np.ndarray:
        """The vectors in `precision`: float64-widened float32, or the quantized codes (each row on its own: no
        range is taken from the request's other texts)."""
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

    async def embed(req: EmbedRequest):
        serves("/embed")
        texts = texts_of(req.inputs, "inputs")
        async with admitted():
            rows, prompt_len = await text_rows(texts, truncate=req.truncate, direction=req.truncation_direction,
                                               prompt_name=req.prompt_name)
            vectors = await run_rows(rows, model.key(req.normalize, None, prompt_len))
        return json_response(quantized(vectors, req.precision))

    async def openai_embeddings(req: OpenAIEmbeddingRequest):
        serves("/v1/embeddings")
        given = req.input
        if isinstance(given, list) and given and isinstance(given[0], int):
            given = [given]  # one text as token ids
        dims = req.dimensions
        if dims is not None and not 1 <= dims <= model.dimension:
            raise ApiError(422, f"dimensions must be in [1, {model.dimension}] (the model's dimension), got {dims}",
                           field="dimensions", limit=model.dimension)
        async with admitted():
            if isinstance(given, list) and given and isinstance(given[0], list):
                if len(given) > limits.max_client_batch_size:
                    texts_of(given, "input")  # raises the batch-size error
                rows, prompt_len = model.check_ids(given), None
            else:
                rows, prompt_len = await text_rows(texts_of(given, "input"), field="input")
            # dimensions: the first dims, renormalized when the model's vectors are unit length
            # (sentence-transformers' truncate_dim with normalization); a plain prefix otherwise.
            key = model.key(True if dims is not None and model.normalizes else None, dims, prompt_len)
            vectors = await run_rows(rows, key)
        tokens = sum(len(r) for r in rows)
        data = quantized(vectors, req.precision)
        if req.encoding_format == "base64":
            raw = vectors.astype("<f4") if req.precision == "float32" else data
            data = [base64.b64encode(v.tobytes()).decode("ascii") for v in raw]
        return json_response({"object": "list", "model": req.model or model.model_id,
                             "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(data)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @app.post("/embed_sparse", response_model=list[list[SparseValue]], summary="TEI: SPLADE sparse embeddings")
    async def embed_sparse(req: EmbedSparseRequest):
        serves("/embed_sparse")
        texts = texts_of(req.inputs, "inputs")
        async with admitted():
            rows, _ = await text_rows(texts, truncate=req.truncate, direction=req.truncation_direction,
                                      prompt_name=req.prompt_name)
            vectors = await run_rows(rows, SPLADE)
        return json_response([[{"index": int(i), "value": float(v[i])} for i in np.flatnonzero(v)] for v in vectors])

    app.post("/embed", response_model=Union[list[list[float]], list[list[int]]],
             summary="TEI: sentence embeddings")(embed)
    app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, summary="OpenAI: embeddings")(openai_embeddings)
    direct = {"/embed": direct_route(EmbedRequest, embed),
              "/v1/embeddings": direct_route(OpenAIEmbeddingRequest, openai_embeddings)}

    @app.post("/tokenize", response_model=list[list[Token]], summary="TEI: the tokens the model sees")
    async def tokenize(req: TokenizeRequest):
        texts = texts_of(req.inputs, "inputs")
        encodings = await off_loop(model.tokenize, texts, truncate=True, add_special_tokens=req.add_special_tokens)
        return json_response([[{"id": i, "text": t, "special": bool(s), "start": None if s else a, "stop": None if s else b}
                              for i, t, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)]
                             for e in encodings])

    @app.get("/health", summary="200 once the model is loaded and warmed up")
    async def health():
        if not batcher.alive:
            raise ApiError(503, "the engine is not running", "unavailable")
        return {"status": "ok"}

    @app.get("/info", response_model=Info, summary="model, precision, backend, ISA tier, limits")
    async def info():
        return state["info"]

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/predict", response_model=Union[list[Prediction], list[list[Prediction]]],
              summary="TEI: sequence classification (labels and scores, best first)")
    async def predict(req: PredictRequest):
        serves("/predict")
        single, inputs = predict_inputs(req.inputs, limits.max_client_batch_size)
        async with admitted():
            scores = await scores_of(inputs, raw=req.raw_scores, truncate=req.truncate,
                                     direction=req.truncation_direction, field="inputs")
        out = [sorted(({"score": float(s), "label": label} for s, label in zip(row, model.labels)),
                      key=lambda p: -p["score"]) for row in scores]
        return json_response(out[0] if single else out)

    @app.post("/rerank", response_model=list[Rank], summary="TEI: texts ranked by relevance to a query, best first")
    async def rerank(req: RerankRequest):
        serves("/rerank")
        if not req.query:
            raise ApiError(422, "query is an empty string", field="query")
        texts = texts_of(req.texts, "texts")
        async with admitted():
            scores = await scores_of([(req.query, t) for t in texts], raw=req.raw_scores, truncate=req.truncate,
                                     direction=req.truncation_direction, field="texts")
        scores = scores[:, 0]
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        return json_response([{"index": i, **({"text": texts[i]} if req.return_text else {}), "score": float(scores[i])}
                             for i in order])

    return Gate(app, max_body=limits.max_body_bytes, api_key=api_key, metrics=metrics, routes=app.routes,
                direct=direct)


def predict_inputs(inputs, max_inputs: int) -> tuple[bool, list]:
    """/predict's `inputs` as TEI reads them -> (single, [text or (text_a, text_b)]): a string or a list of
    one or two strings is one input; a list of lists is a batch of them. Errors name the JSON path."""
    if isinstance(inputs, str):
        if not inputs:
            raise ApiError(422, "inputs is an empty string", field="inputs")
        return True, [inputs]
    if not inputs:
        raise ApiError(422, "inputs is empty: send a text, a pair or a batch of them", field="inputs")
    single = isinstance(inputs[0], str)
    batch = [inputs] if single else inputs
    if len(batch) > max_inputs:
        raise ApiError(413, f"inputs has {len(batch)} items, more than the limit of {max_inputs} "
                       "(--max-client-batch-size)", field="inputs", limit=max_inputs)
    out = []
    for i, item in enumerate(batch):
        where = "inputs" if single else f"inputs[{i}]"
        if len(item) not in (1, 2):
            hint = ' (a batch of single texts is [["a"], ["b"], ...])' if single else ""
            raise ApiError(422, f"{where} has {len(item)} strings: an input is one text or a pair of two{hint}",
                           field=where)
        for j, text in enumerate(item):
            if not text:
                raise ApiError(422, f"{where}[{j}] is an empty string", field=f"{where}[{j}]")
        out.append(item[0] if len(item) == 1 else (item[0], item[1]))
    return single, out


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an ErrorBody: ours, pydantic's (field from its location), Starlette's 404/405."""

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
        if first["type"] == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                            field="body").response()
        loc = [str(p) for p in first["loc"] if p != "body"]
        field = loc[0] if loc else "body"
        schema = SCHEMAS.get(request.url.path)
        hint = schema.model_fields[field].description if schema and field in schema.model_fields else None
        message = f"{field} must be {hint}" if hint else f"{field}: {first['msg']}"
        if first["type"] == "missing":
            message = f"{field} is required" + (f": {hint}" if hint else "")
        elif not loc:
            message = "the body must be a JSON object"
        return ApiError(422, message, field=field).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return ApiError(e.status_code, message, kinds.get(e.status_code, "http")).response(getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(request, e: Exception):
        return internal_error(e).response()
