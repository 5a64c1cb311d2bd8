"""TEI's default route: POST / (Hugging Face's inference clients post there) and POST /invocations (SageMaker) answer
as the route of the model's kind (`model.DEFAULT_ROUTE`, TEI's choice by model type): /embed, /predict, /rerank,
/embed_sparse, or ColBERT's /embed_multi. An embedding model's body whose `inputs` is an object is a sentence-similarity
request (/similarity), which TEI serves at / only when started with TASK=sentence-similarity.

The body picks the model by its `model` field as every model route does, then is read by that route's schema: each
error is the one that route itself gives for the same body.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Depends
from pydantic import ValidationError
from starlette.requests import Request

from . import routes_tasks, routes_tei
from .model import DEFAULT_ROUTE
from .schemas import (EmbedMultiRequest, EmbedRequest, EmbedSparseRequest, PredictRequest, RerankRequest,
                      SimilarityRequest, invalid_request)
from .service import Service, service_of

router = APIRouter(tags=["TEI"])

# route -> (its request schema, its handler(req, service))
HANDLERS = {"/embed": (EmbedRequest, routes_tei.embed), "/similarity": (SimilarityRequest, routes_tei.similarity),
            "/embed_sparse": (EmbedSparseRequest, routes_tei.embed_sparse),
            "/embed_multi": (EmbedMultiRequest, routes_tei.embed_multi),
            "/predict": (PredictRequest, routes_tasks.predict), "/rerank": (RerankRequest, routes_tasks.rerank)}
DESCRIPTION = ("The body of the route the model's kind answers by default (GET /info: `default_route`): /embed "
               "(embedding models, BGE-M3; an object `inputs` {source_sentence, sentences}: /similarity), /predict "
               "(classifiers), /rerank (rerankers), /embed_sparse (SPLADE), /embed_multi (ColBERT).")


def route_of(kind: str, body) -> str:
    """The route that answers `body` at / for a model of `kind`."""
    route = DEFAULT_ROUTE[kind]
    if route == "/embed" and isinstance(body, dict) and isinstance(body.get("inputs"), dict):
        return "/similarity"
    return route


@router.post("/", summary="TEI: the model's default route", description=DESCRIPTION)
@router.post("/invocations", summary="TEI: the model's default route (SageMaker)", description=DESCRIPTION)
async def invoke(request: Request, service: Service = Depends(service_of)):
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None  # the default route's schema says why, as that route would
    name = body.get("model") if isinstance(body, dict) else None
    engine = service.engine(name if isinstance(name, str) else None)  # another type: the schema's 422 below
    schema, handler = HANDLERS[route_of(engine.model.kind, body)]
    try:
        req = schema.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_request(e.errors(), schema) from None
    return await handler(req, service)
