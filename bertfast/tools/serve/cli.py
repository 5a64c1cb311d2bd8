"""`bertfast serve`: parse the options, build the app, run uvicorn (SIGTERM/SIGINT: graceful stop)."""

from __future__ import annotations

import logging
import os
import sys


def add_arguments(p):
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]DIR",
                   help="a model directory, optionally named NAME (default name: the directory's); repeat it to serve "
                        "several, each on its own engine thread with its own --max-batch-tokens and "
                        "--max-concurrent-requests: a request picks one by its `model` field, the first is the "
                        "default (no --model: the embedded all-MiniLM-L6-v2). A *ForSequenceClassification "
                        "checkpoint is served as a classifier (/predict), with one label as a reranker (/rerank); a "
                        "sentence-transformers SparseEncoder (SPLADE) as a sparse model (/embed_sparse); a PyLate "
                        "ColBERT (/embed_multi) and a BGE-M3 directory (/embed, /embed_sparse, /embed_multi) as "
                        "multi-vector models")
    p.add_argument("--adapter", action="append", default=None, metavar="[MODEL:]NAME=DIR",
                   help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) served as "
                        "NAME on the model named MODEL (default: the first); repeat it for several. Any model kind "
                        "(a classifier's, reranker's or SPLADE model's adapter runs its own head on its rows); a "
                        "request picks it by TEI's `adapter` field or OpenAI's \"model\": \"MODEL:NAME\"")
    p.add_argument("--adapter-root", default=None, metavar="DIR",
                   help="let the admin route (POST /admin/adapters, DELETE /admin/adapters/NAME) load LoRA adapters "
                        "at run time from directories under DIR (needs --api-key)")
    p.add_argument("--model-id", default=None,
                   help="the first model's name when --model gives it none (the name /info, /v1/models and "
                        "/v1/embeddings report)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", default="auto", help="auto, cpu, torch, triton")
    p.add_argument("--dtype", default=None, help="float32, bf16, fp16, int8 or auto (default: the checkpoint's)")
    p.add_argument("--pooling", default=None,
                   help="override an embedding model's pooling: a mode (mean, cls, max, ...) or several joined by "
                        "commas (ignored, with a warning, for classifiers and rerankers)")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="real tokens per model call (merging budget), each model")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="requests accepted at once, each model; more are answered 429 immediately")
    p.add_argument("--max-client-batch-size", type=int, default=32, help="texts per request")
    p.add_argument("--max-body-bytes", type=int, default=2_000_000, help="request body limit (413 above)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but /health)")
    p.add_argument("--ranges", default=None, metavar="FILE.npy",
                   help="the (2, D) int8/uint8 quantization ranges that requests with precision int8 or uint8 use "
                        "(numpy.save(FILE, bertfast.quantization_ranges(sample_embeddings)))")
    p.add_argument("--log-level", default="info", help="uvicorn's log level; access lines are JSON on stderr")


def run(args) -> int:
    try:
        import uvicorn

        from .app import Limits, create_app
        from .model import DEFAULT_MODEL_ID, ServedModel
    except ImportError as e:
        print(f"bertfast serve needs the serve extra (pip install 'bertfast[serve]'): {e}", file=sys.stderr)
        return 2
    import bertfast

    for name in ("max_batch_tokens", "max_concurrent_requests", "max_client_batch_size", "max_body_bytes"):
        if getattr(args, name) < 1:
            print(f"bertfast serve: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        named = model_args(args.model, args.model_id, bertfast.default_model_path)
        pooling = tuple(args.pooling.split(",")) if args.pooling else None
        models = [ServedModel(path, backend=args.backend, dtype=args.dtype, pooling=pooling,
                              model_id=name or (None if args.model else DEFAULT_MODEL_ID)) for name, path in named]
        adapters = adapter_args(args.adapter, [m.model_id for m in models])
    except (RuntimeError, ValueError) as e:
        print(f"bertfast serve: {e}", file=sys.stderr)
        return 2
    if args.adapter_root is not None and not os.path.isdir(args.adapter_root):
        print(f"bertfast serve: --adapter-root {args.adapter_root} is not a directory", file=sys.stderr)
        return 2
    if args.adapter_root is not None and args.api_key is None:
        print("bertfast serve: --adapter-root needs --api-key: the admin route loads files on the server",
              file=sys.stderr)
        return 2
    ranges = None
    if args.ranges is not None:
        from bertfast.precision import load_ranges

        try:
            ranges = load_ranges(args.ranges)
        except ValueError as e:
            print(f"bertfast serve: --ranges {e}", file=sys.stderr)
            return 2
    for m in models:
        m.adapter_paths = adapters[m.model_id]
    limits = Limits(args.max_batch_tokens, args.max_concurrent_requests, args.max_client_batch_size,
                    args.max_body_bytes)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("bertfast.serve.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    try:
        app = create_app(models, limits, args.api_key, ranges, args.adapter_root)
    except ValueError as e:  # two models of one name
        print(f"bertfast serve: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="on")
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def model_args(given: list[str] | None, model_id: str | None, default_path) -> list[tuple[str | None, str]]:
    """--model values -> [(name or None: the directory's, directory)]; ValueError naming a value that is not a
    directory. A value that is a directory is one, '=' and all; else NAME=DIR names it. default_path() gives the
    embedded model's directory when no --model is given."""
    if not given:
        return [(model_id, default_path())]
    out = []
    for i, value in enumerate(given):
        name, sep, path = value.partition("=")
        if os.path.isdir(value) or not sep:
            name, path = None, value
        elif not name:
            raise ValueError(f"--model {value}: the name before '=' is empty (NAME=DIR)")
        if not os.path.isdir(path):
            raise ValueError(f"--model {path} is not a directory")
        out.append((name or (model_id if i == 0 else None), path))
    return out


def adapter_args(given: list[str] | None, models: list[str]) -> dict[str, dict[str, str]]:
    """--adapter values -> {model name: {adapter name: directory}} for every name in `models` (the served models'
    names, the first the default); ValueError naming a value whose model is not served, whose name is empty or
    given twice for one model, or whose directory holds no adapter_config.json and adapter_model.safetensors.
    [MODEL:]NAME=DIR: the text before the first '=' is the names (an adapter name holds no ':'), the rest the
    directory."""
    out: dict[str, dict[str, str]] = {name: {} for name in models}
    for value in given or ():
        names, sep, path = value.partition("=")
        model, colon, name = names.rpartition(":")
        model = model if colon else models[0]
        if not sep or not name or not path:
            raise ValueError(f"--adapter {value}: expected [MODEL:]NAME=DIR (an adapter name, '=', its directory)")
        if model not in out:
            raise ValueError(f"--adapter {value}: no model named {model!r} is served (served: {', '.join(models)})")
        if name in out[model]:
            raise ValueError(f"--adapter {value}: the model {model!r} already has an adapter named {name!r}")
        if not os.path.isdir(path):
            raise ValueError(f"--adapter {value}: {path} is not a directory")
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.isfile(os.path.join(path, file)):
                raise ValueError(f"--adapter {value}: {path} has no {file} (a PEFT LoRA directory, safetensors only)")
        out[model][name] = path
    return out
