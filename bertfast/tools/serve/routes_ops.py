"""The server's own routes: /health (every engine thread running; also at GET / and /ping, TEI's aliases for the
inference-API and SageMaker probes), /info (a model: what it is, the backend, the limits) and /metrics
(Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response

from .schemas import ApiError, Info
from .service import Service, service_of

router = APIRouter(tags=["server"])


@router.get("/health", summary="200 once every model is loaded and warmed up")
@router.get("/", summary="health (TEI's alias)")
@router.get("/ping", summary="health (TEI's alias: SageMaker's probe)")
async def health(service: Service = Depends(service_of)):
    if not service.alive:
        raise ApiError(503, "the engine is not running", "unavailable")
    return {"status": "ok"}


@router.get("/info", response_model=Info, summary="model, precision, backend, ISA tier, limits")
async def info(model: str | None = Query(None, description="a served model's name (default: the first)"),
               service: Service = Depends(service_of)):
    return service.engine(model).info


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(service: Service = Depends(service_of)):
    return Response(service.metrics.render(), media_type=service.metrics.content_type)
