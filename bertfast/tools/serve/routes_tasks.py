"""TEI's routes of sequence classifiers and cross-encoders: /predict (labels and scores, best first) and /rerank
(texts scored against a query, best first). Scores come from the engine thread (`model.SCORES` / `LOGITS`), with the
request's `adapter` (one of the model's LoRA adapters, its head included; 404 otherwise; absent: the base model) as
TEI's embedding routes take it (`routes_tei`)."""

from __future__ import annotations

from typing import Union

from fastapi import APIRouter, Depends

from .schemas import ApiError, Prediction, PredictRequest, Rank, RerankRequest, json_response
from .service import Service, service_of

router = APIRouter(tags=["TEI"])


@router.post("/predict", response_model=Union[list[Prediction], list[list[Prediction]]],
             summary="TEI: sequence classification (labels and scores, best first)")
async def predict(req: PredictRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    engine.serves("/predict")
    adapter = engine.adapter(req.adapter)
    single, inputs = predict_inputs(req.inputs, engine.limits.max_client_batch_size)
    async with engine.admitted(adapter):
        scores = await engine.scores_of(inputs, raw=req.raw_scores, truncate=req.truncate,
                                        direction=req.truncation_direction, field="inputs", adapter=adapter)
    labels = engine.model.labels
    out = [sorted(({"score": float(s), "label": label} for s, label in zip(row, labels)), key=lambda p: -p["score"])
           for row in scores]
    return json_response(out[0] if single else out)


@router.post("/rerank", response_model=list[Rank], summary="TEI: texts ranked by relevance to a query, best first")
async def rerank(req: RerankRequest, service: Service = Depends(service_of)):
    engine = service.engine(req.model)
    engine.serves("/rerank")
    adapter = engine.adapter(req.adapter)
    if not req.query:
        raise ApiError(422, "query is an empty string", field="query")
    texts = engine.texts_of(req.texts, "texts")
    async with engine.admitted(adapter):
        scores = await engine.scores_of([(req.query, t) for t in texts], raw=req.raw_scores, truncate=req.truncate,
                                        direction=req.truncation_direction, field="texts", adapter=adapter)
    scores = scores[:, 0]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    return json_response([{"index": i, **({"text": texts[i]} if req.return_text else {}), "score": float(scores[i])}
                         for i in order])


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
