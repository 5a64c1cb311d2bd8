"""TEI's embedding routes: /embed (sentence embeddings, `dimensions`, `precision`; BGE-M3's dense vectors), /embed_all
(every token's final hidden state), /embed_sparse (SPLADE; BGE-M3's lexical weights), /similarity (the cosine of
/embed's vectors), /tokenize and /decode (its inverse), and bertfast's /embed_multi in their style (ColBERT and
BGE-M3: every text's normalized token vectors).

Each route picks its model by the request's `model` field (the default model without one), checks the model's kind
(424 naming what it is otherwise), the adapter (`adapter`: one of the model's LoRA adapters, 404 otherwise; absent: the
base model) and the inputs, then queues rows on that model's engine thread; see `service`.
"""

from __future__ import annotations

from functools import partial
from typing import Union

import numpy as np
from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from .model import LEXICAL, SPLADE, TOKENS
from .schemas import (ApiError, DecodeRequest, EmbedAllRequest, EmbedMultiRequest, EmbedRequest, EmbedSparseRequest,
                      SimilarityParameters, SimilarityRequest, SparseValue, TextsRequest, Token, TokenizeRequest,
                      json_response)
from .service import INLINE_TOKENIZE_CHARS, Engine, Service, off_loop, service_of

router = APIRouter(tags=["TEI"])


async def run_text_rows(req: TextsRequest, service: Service, route: str, key, check=None):
    """What the text routes share: the request's model (its kind checked for `route`, then check(engine) if given),
    its inputs tokenized (truncation, prompt) and run as rows on the model's engine thread; key(engine, prompt_len)
    names what a row returns. Returns (engine, one result per input)."""
    engine = service.engine(req.model)
    engine.serves(route)
    adapter = engine.adapter(req.adapter)
    if check is not None:
        check(engine)
    texts = engine.texts_of(req.inputs, "inputs")
    async with engine.admitted(adapter):
        rows, prompt_len = await engine.text_rows(texts, truncate=req.truncate, direction=req.truncation_direction,
                                                  prompt_name=req.prompt_name)
        return engine, await engine.run_rows(rows, key(engine, prompt_len), adapter=adapter)


@router.post("/embed", response_model=Union[list[list[float]], list[list[int]]], summary="TEI: sentence embeddings")
async def embed(req: EmbedRequest, service: Service = Depends(service_of)):
    dims, normalize = req.dimensions, req.normalize

    def check(engine: Engine):
        if dims is not None and engine.model.m3 is not None:
            raise ApiError(422, "dimensions is not available for BGE-M3: its dense vectors are used whole",
                           field="dimensions")
        engine.check_dimensions(dims)

    def key(engine: Engine, prompt_len):
        unit = normalize
        if unit is None and dims is not None and engine.model.normalizes:
            unit = True  # a normalizing model's prefix is renormalized (sentence-transformers' truncate_dim)
        return engine.model.key(unit, dims, prompt_len)

    engine, vectors = await run_text_rows(req, service, "/embed", key, check)
    return json_response(engine.quantized(vectors, req.precision))


def cosines(source: np.ndarray, others: np.ndarray) -> np.ndarray:
    """(N,) float64 cosine similarities of others (N, D) float32 to source (D,) float32."""
    a, b = source.astype(np.float64), others.astype(np.float64)
    return b @ a / (np.linalg.norm(b, axis=1) * np.linalg.norm(a))


@router.post("/similarity", response_model=list[float],
             summary="TEI: each sentence's cosine similarity to the source sentence (sentence-similarity)")
async def similarity(req: SimilarityRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    engine.serves("/similarity")
    adapter = engine.adapter(req.adapter)
    source, params = req.inputs.source_sentence, req.parameters or SimilarityParameters()
    if not source:
        raise ApiError(422, "inputs.source_sentence is an empty string", field="inputs.source_sentence")
    sentences = engine.texts_of(req.inputs.sentences, "inputs.sentences")
    names = ["inputs.source_sentence"] + [f"inputs.sentences[{i}]" for i in range(len(sentences))]
    async with engine.admitted(adapter):
        rows, prompt_len = await engine.text_rows([source, *sentences], truncate=params.truncate,
                                                  direction=params.truncation_direction,
                                                  prompt_name=params.prompt_name, field=names)
        # TEI's: the vectors unnormalized, then their cosines.
        vectors = await engine.run_rows(rows, engine.model.key(False, None, prompt_len), adapter=adapter)
    return json_response(cosines(vectors[0], vectors[1:]))


@router.post("/embed_all", response_model=list[list[list[float]]],
             summary="TEI: every token's final hidden state (special and prompt tokens included)")
async def embed_all(req: EmbedAllRequest, service: Service = Depends(service_of)):
    _, states = await run_text_rows(req, service, "/embed_all", lambda engine, prompt_len: TOKENS)
    return json_response([s.astype(np.float64) for s in states])


def sparse_entries(v) -> list[dict]:
    """One row's nonzero entries in ascending index order: a SPLADE vector's (vocab,) array, or BGE-M3's lexical
    weights {str(token id): weight}."""
    if isinstance(v, dict):
        return [{"index": i, "value": float(v[str(i)])} for i in sorted(map(int, v))]
    return [{"index": int(i), "value": float(v[i])} for i in np.flatnonzero(v)]


@router.post("/embed_sparse", response_model=list[list[SparseValue]],
             summary="TEI: sparse embeddings (SPLADE vectors, BGE-M3's lexical weights)")
async def embed_sparse(req: EmbedSparseRequest, service: Service = Depends(service_of)):
    _, vectors = await run_text_rows(req, service, "/embed_sparse",
                                     lambda engine, prompt_len: LEXICAL if engine.model.m3 is not None else SPLADE)
    return json_response([sparse_entries(v) for v in vectors])


@router.post("/embed_multi", response_model=list[list[list[float]]],
             summary="ColBERT and BGE-M3: every text's normalized token vectors (late interaction)")
async def embed_multi(req: EmbedMultiRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    engine.serves("/embed_multi")
    adapter = engine.adapter(req.adapter)
    texts = engine.texts_of(req.inputs, "inputs")
    async with engine.admitted(adapter):
        vectors = await engine.multi_vectors(texts, is_query=req.is_query, truncate=req.truncate,
                                             prompt_name=req.prompt_name, adapter=adapter)
    return json_response([v.astype(np.float64) for v in vectors])


@router.post("/tokenize", response_model=list[list[Token]], summary="TEI: the tokens the model sees")
async def tokenize(req: TokenizeRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    texts = engine.texts_of(req.inputs, "inputs")
    encodings = await off_loop(engine.model.tokenize, texts, truncate=True, add_special_tokens=req.add_special_tokens)
    return json_response([[{"id": i, "text": t, "special": bool(s), "start": None if s else a, "stop": None if s else b}
                          for i, t, s, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)]
                         for e in encodings])


@router.post("/decode", response_model=list[str], summary="TEI: token ids back to text (the inverse of /tokenize)")
async def decode(req: DecodeRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    rows = [req.ids] if req.ids and isinstance(req.ids[0], int) else req.ids
    if not rows:
        raise ApiError(422, "ids is empty: send a list of token ids or a list of lists of them", field="ids")
    engine.check_count(len(rows), "ids")
    run = partial(engine.model.decode, rows, req.skip_special_tokens)
    return json_response(run() if sum(map(len, rows)) <= INLINE_TOKENIZE_CHARS else await run_in_threadpool(run))
