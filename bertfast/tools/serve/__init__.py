"""`bertfast serve`: an HTTP embedding, classification and rerank server (TEI- and OpenAI-compatible
routes) over one engine thread per served model.

cli (arguments, uvicorn) -> app (the FastAPI app: routers, errors) -> routes_tei, routes_tasks, routes_openai,
routes_ops (the routes, grouped) over service (the served models by name: each a model, its engine thread and its
limits) -> model (what the model is, tokenize off the engine thread, run a batch through the public `Encoder` /
`TaskModel` API) and batcher (one engine thread, token-budget batches, bounded admission); schemas holds the
request/response models, gate the per-request middleware (body limit, API key, access log, latency metrics). The
server owns no model math.
"""
