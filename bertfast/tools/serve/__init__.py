"""`bertfast serve`: an HTTP embedding, classification and rerank server (TEI- and OpenAI-compatible
routes) over one engine thread.

cli (arguments, uvicorn) -> app (routes, errors) -> model (what the model is, tokenize off the engine
thread, run a batch through the public `Encoder` / `TaskModel` API) and batcher (one engine thread,
token-budget batches, bounded admission); schemas holds the request/response models, gate the
per-request middleware (body limit, API key, access log, latency metrics). The server owns no model
math.
"""
