"""The admin routes: LoRA adapters loaded and unloaded at run time (POST /admin/adapters, DELETE
/admin/adapters/{name}), behind the API key as every route, and only on a server started with --adapter-root.

A load names a directory relative to that root (`adapter_dir`): an absolute path, a `..` component, or a path or
file that resolves outside the root (a symlink out of it) is a 422 naming `path`; the directory's files are read
by `Encoder.load_adapter`, or a classifier's, reranker's or SPLADE model's `load_adapter` (its head too), safetensors
only: a pickle adapter_model.bin is refused. Loading runs on the model's engine thread between two batches; an unload
refuses the adapter to new requests at once and waits for the ones that hold it, so no request in flight is dropped
(`service.Engine`).
"""

from __future__ import annotations

import os

from fastapi import APIRouter, Depends

from .schemas import AdapterLoadRequest, AdapterState, ApiError
from .service import Service, service_of

router = APIRouter(tags=["Admin"])
FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a load reads; each must resolve inside the root


def adapter_dir(root: str, given: str) -> str:
    """The real path of adapter directory `given` (relative to `root`); ValueError saying why it is refused."""
    if not given or os.path.isabs(given) or given.startswith("~"):
        raise ValueError(f"path {given!r} must be a directory relative to the server's --adapter-root")
    if ".." in given.replace("\\", "/").split("/"):
        raise ValueError(f"path {given!r} holds '..': name a directory under the server's --adapter-root")
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, given))
    for p in (path, *(os.path.join(path, f) for f in FILES)):
        real = os.path.realpath(p)
        if os.path.commonpath([real_root, real]) != real_root:
            raise ValueError(f"path {given!r} leads outside the server's --adapter-root (a symlink out of it)")
    if not os.path.isdir(path):
        raise ValueError(f"path {given!r} is not a directory under the server's --adapter-root")
    return path


def admin_root(service: Service) -> str:
    if service.adapter_root is None:
        raise ApiError(403, "adapters are loaded at run time only on a server started with --adapter-root DIR",
                       "admin_disabled")
    return service.adapter_root


def state(engine) -> dict:
    return {"model": engine.name, "adapters": list(engine.live)}


@router.post("/admin/adapters", response_model=AdapterState,
             summary="Admin: load a LoRA adapter from a directory under --adapter-root")
async def load_adapter(req: AdapterLoadRequest, service: Service = Depends(service_of)):
    root = admin_root(service)
    engine = service.engine(req.model)
    try:
        path = adapter_dir(root, req.path)
    except ValueError as e:
        raise ApiError(422, str(e), field="path") from None
    async with engine.admitted():
        await engine.load_adapter(req.name, path)
    return state(engine)


@router.delete("/admin/adapters/{name}", response_model=AdapterState,
               summary="Admin: unload a LoRA adapter once the requests using it are answered")
async def unload_adapter(name: str, model: str | None = None, service: Service = Depends(service_of)):
    admin_root(service)
    engine = service.engine(model)
    async with engine.admitted():
        await engine.unload_adapter(name)
    return state(engine)
