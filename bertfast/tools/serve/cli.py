"""`bertfast serve`: parse the options, build the app, run uvicorn (SIGTERM/SIGINT: graceful stop)."""

from __future__ import annotations

import logging
import os
import sys


def add_arguments(p):
    p.add_argument("--model", default=None,
                   help="model directory (default: the embedded all-MiniLM-L6-v2); a *ForSequenceClassification "
                        "checkpoint is served as a classifier (/predict), with one label as a reranker (/rerank); a "
                        "sentence-transformers SparseEncoder (SPLADE) as a sparse model (/embed_sparse)")
    p.add_argument("--model-id", default=None, help="the name /info and /v1/embeddings report (default: the directory's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backend", default="auto", help="auto, cpu, torch, triton")
    p.add_argument("--dtype", default=None, help="float32, bf16, fp16, int8 or auto (default: the checkpoint's)")
    p.add_argument("--pooling", default=None,
                   help="override an embedding model's pooling: a mode (mean, cls, max, ...) or several joined by "
                        "commas (ignored, with a warning, for classifiers and rerankers)")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="real tokens per model call (merging budget)")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="requests accepted at once; more are answered 429 immediately")
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
        path = args.model or bertfast.default_model_path()
    except RuntimeError as e:
        print(f"bertfast serve: {e}", file=sys.stderr)
        return 2
    if not os.path.isdir(path):
        print(f"bertfast serve: --model {path} is not a directory", file=sys.stderr)
        return 2
    ranges = None
    if args.ranges is not None:
        from bertfast.precision import load_ranges

        try:
            ranges = load_ranges(args.ranges)
        except ValueError as e:
            print(f"bertfast serve: --ranges {e}", file=sys.stderr)
            return 2
    pooling = tuple(args.pooling.split(",")) if args.pooling else None
    model = ServedModel(path, backend=args.backend, dtype=args.dtype, pooling=pooling,
                        model_id=args.model_id or (None if args.model else DEFAULT_MODEL_ID))
    limits = Limits(args.max_batch_tokens, args.max_concurrent_requests, args.max_client_batch_size,
                    args.max_body_bytes)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("bertfast.serve.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    config = uvicorn.Config(create_app(model, limits, args.api_key, ranges), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
