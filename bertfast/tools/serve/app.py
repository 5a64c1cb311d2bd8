"""The server's ASGI app: the Gate in front of a FastAPI app whose routes are routers over one `Service`.

Routers: TEI's embedding routes (`routes_tei`: /embed, /embed_all, /embed_sparse, /similarity, /tokenize, /decode;
bertfast's /embed_multi), its classifier and reranker routes (`routes_tasks`: /predict, /rerank), OpenAI's
(`routes_openai`: /v1/embeddings and TEI's alias /embeddings, /v1/models), the server's own (`routes_ops`: /health
and TEI's aliases GET / and /ping, /info, /metrics), TEI's default route (`routes_default`: POST / and
/invocations, the route of the model's kind) and the admin routes (`routes_admin`: adapters loaded and unloaded at
run time). The Service holds the served models by name, each with its engine
thread and limits (`service`). Responses are serialized by orjson (the float32 results widened to float64 first: the
same numbers `tolist()` gives, an order of magnitude faster than `json.dumps`). Every error is one `ApiError` response, whichever layer raises it.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from . import routes_admin, routes_default, routes_ops, routes_openai, routes_tasks, routes_tei
from .gate import Gate
from .model import ServedModel
from .schemas import (AdapterLoadRequest, ApiError, DecodeRequest, EmbedAllRequest, EmbedMultiRequest, EmbedRequest,
                      EmbedSparseRequest,
                      ErrorBody, OpenAIEmbeddingRequest, PredictRequest, RerankRequest, SimilarityRequest,
                      TokenizeRequest, invalid_request)
from .service import Limits, Service

__all__ = ["Limits", "Service", "create_app"]

SCHEMAS = {"/embed": EmbedRequest, "/embed_all": EmbedAllRequest, "/embed_sparse": EmbedSparseRequest,
           "/embed_multi": EmbedMultiRequest, "/similarity": SimilarityRequest,
           "/tokenize": TokenizeRequest, "/decode": DecodeRequest, "/v1/embeddings": OpenAIEmbeddingRequest,
           "/embeddings": OpenAIEmbeddingRequest, "/predict": PredictRequest, "/rerank": RerankRequest,
           "/admin/adapters": AdapterLoadRequest}
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 403, 404, 405, 409, 413, 422, 424, 429, 503)}


def internal_error(e: Exception) -> ApiError:
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal")


def direct_route(schema, handler, service: Service):
    """The Gate's direct path for a route: body -> handler(schema, service) -> its Response (errors the handler
    raises included), or None when the body does not fit the schema (the FastAPI app then answers, with the error
    it writes for that body)."""

    async def answer(body: bytes):
        try:
            req = schema.model_validate_json(body)
        except ValidationError:
            return None
        try:
            return await handler(req, service)
        except ApiError as e:
            return e.response()
        except Exception as e:  # noqa: BLE001  as the app's handler of last resort does
            return internal_error(e).response()

    return answer


def create_app(models: ServedModel | list[ServedModel], limits: Limits | list[Limits] = Limits(),
               api_key: str | None = None, ranges=None, adapter_root: str | None = None) -> Gate:
    """The server's ASGI app: the Gate in front of the FastAPI app (which serves /openapi.json). models: one model
    or several (the first is the default); limits: one Limits for each model, or one per model (the body limit is
    the first's); ranges: the (2, D) int8/uint8 quantization ranges (--ranges), or None (those precisions are
    refused); adapter_root: the directory the admin route loads adapters from (None: the admin route answers 403)."""
    service = Service(models if isinstance(models, (list, tuple)) else [models], limits, ranges, adapter_root)

    @asynccontextmanager
    async def lifespan(app):
        await service.start()  # a load error stops the server here
        yield
        await run_in_threadpool(service.close)  # uvicorn has answered every request by now

    app = FastAPI(title="bertfast serve", version="0.1.0", lifespan=lifespan, responses=ERRORS,
                  description="Embeddings, scores and ranks from BERT-family encoders, each model batched on its "
                              "own engine thread.")
    app.state.service = service
    install_error_handlers(app)
    routers = [m.router for m in (routes_tei, routes_tasks, routes_openai, routes_ops, routes_admin,
                                   routes_default)]
    for router in routers:
        app.include_router(router)
    # The Gate names a request by its route's template: the routers' routes (FastAPI may keep an included router
    # as one entry of app.routes, without a path of its own) and the app's own (/openapi.json, /docs).
    routes = [r for router in routers for r in router.routes] + [r for r in app.routes if hasattr(r, "path")]
    openai = direct_route(OpenAIEmbeddingRequest, routes_openai.embeddings, service)
    direct = {"/embed": direct_route(EmbedRequest, routes_tei.embed, service), "/v1/embeddings": openai,
              "/embeddings": openai}
    return Gate(app, max_body=service.limits.max_body_bytes, api_key=api_key, metrics=service.metrics,
                routes=routes, direct=direct)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as an ErrorBody (an unknown model on /v1: OpenAI's shape): ours, pydantic's (field from its
    location), Starlette's 404/405."""

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        return invalid_request(e.errors(), SCHEMAS.get(request.url.path)).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return ApiError(e.status_code, message, kinds.get(e.status_code, "http")).response(getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def crashed(request, e: Exception):
        return internal_error(e).response()
