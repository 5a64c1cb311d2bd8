"""OpenAI's routes: /v1/embeddings (texts or token ids; `dimensions`, `encoding_format`, `precision`; also at
/embeddings, TEI's alias, which an OpenAI client with the server's root as its base_url posts to) and /v1/models
(the served models and their LoRA adapters as MODEL:ADAPTER, OpenAI's list shape). The request's `model` picks the
model, "MODEL:ADAPTER" one of its adapters; with several served, an unknown model is a 404 in OpenAI's error shape, and
an unknown adapter is one on any server."""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends

from .schemas import ModelCard, ModelList, OpenAIEmbeddingRequest, OpenAIEmbeddingResponse, json_response
from .service import Service, service_of

router = APIRouter(tags=["OpenAI"])


@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, summary="OpenAI: embeddings")
@router.post("/embeddings", response_model=OpenAIEmbeddingResponse, summary="OpenAI: embeddings (TEI's alias)")
async def embeddings(req: OpenAIEmbeddingRequest, service: Service = Depends(service_of)):
    engine, adapter = service.openai_model(req.model)
    model = engine.model
    engine.serves("/v1/embeddings")
    given = req.input
    if isinstance(given, list) and given and isinstance(given[0], int):
        given = [given]  # one text as token ids
    dims = req.dimensions
    engine.check_dimensions(dims)
    async with engine.admitted(adapter, openai=True):
        if isinstance(given, list) and given and isinstance(given[0], list):
            engine.check_count(len(given), "input")
            rows, prompt_len = model.check_ids(given), None
        else:
            rows, prompt_len = await engine.text_rows(engine.texts_of(given, "input"), field="input")
        # dimensions: the first dims, renormalized when the model's vectors are unit length
        # (sentence-transformers' truncate_dim with normalization); a plain prefix otherwise.
        key = model.key(True if dims is not None and model.normalizes else None, dims, prompt_len)
        vectors = await engine.run_rows(rows, key, adapter=adapter)
    tokens = sum(len(r) for r in rows)
    data = engine.quantized(vectors, req.precision)
    if req.encoding_format == "base64":
        raw = vectors.astype("<f4") if req.precision == "float32" else data
        data = [base64.b64encode(v.tobytes()).decode("ascii") for v in raw]
    return json_response({"object": "list", "model": req.model or engine.name,
                          "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(data)],
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def card(service: Service, name: str) -> dict:
    return ModelCard(id=name, created=service.created, owned_by="bertfast").model_dump()


@router.get("/v1/models", response_model=ModelList,
            summary="OpenAI: the served models (the first is the default), each followed by its adapters MODEL:ADAPTER")
async def models(service: Service = Depends(service_of)):
    return {"object": "list", "data": [card(service, name) for name in service.names()]}


@router.get("/v1/models/{model:path}", response_model=ModelCard, summary="OpenAI: one served model or adapter")
async def model(model: str, service: Service = Depends(service_of)):
    if model not in service.names():
        raise service.unknown(model, openai=True)
    return card(service, model)
