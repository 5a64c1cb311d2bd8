"""The ASGI app in front of the FastAPI app: API key, body size and UTF-8 checks, access log, metrics,
and the direct path of the hot routes.

It reads the whole body first (at most `max_body` bytes, else 413 without reading on), so a route
never sees an oversized or non-UTF-8 body. Each request, answered or refused, gets one JSON access
log line (logger `bertfast.serve.access`) and one latency observation under its route template.
A JSON POST to a route in `direct` (the embedding routes) is answered by that route's handler
without FastAPI's routing and middleware, which cost the event loop more than the handler on a
one-sentence request; a body the handler's schema rejects goes to the FastAPI app instead, so every
error is written by one code path.
"""

from __future__ import annotations

import hmac
import logging
import time

import orjson

from starlette.routing import Match

from .schemas import ApiError

access_log = logging.getLogger("bertfast.serve.access")
# Reachable by GET without the API key: liveness probes (TEI's /health, / and /ping) and the schema.
OPEN_PATHS = frozenset({"/health", "/", "/ping", "/openapi.json", "/docs", "/docs/oauth2-redirect"})


class Gate:
    def __init__(self, app, *, max_body: int, api_key: str | None, metrics, routes, direct=None):
        self.app, self.max_body, self.api_key, self.metrics = app, max_body, api_key, metrics
        self.routes = routes  # the app's routes (each with its `path` template), to name a path by its template
        # path -> async answer(body) -> a Response, or None to leave the request to the app (POST only)
        self.direct = direct or {}
        self.names: dict[str, str] = {}  # path -> template, for paths that matched one (bounded: see below)

    def route_name(self, scope) -> str:
        name = self.names.get(scope["path"])
        if name is not None:
            return name
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                if len(self.names) < 1024:  # paths with parameters could be many
                    self.names[scope["path"]] = route.path
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, size = time.perf_counter(), [500], [0]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self.authorize(scope)
            if refusal is None:
                body, refusal = await self.read_body(receive)
                size[0] = len(body)
            if refusal is not None:
                await refusal.response()(scope, receive, send_status)
                return
            answer = self.direct.get(scope["path"]) if scope["method"] == "POST" and is_json(scope) else None
            response = None if answer is None else await answer(body)
            if response is not None:
                await response(scope, receive, send_status)
            else:
                await self.app(scope, replay(body, receive), send_status)
        finally:
            seconds = time.perf_counter() - start
            self.metrics.on_request(self.route_name(scope), status[0], seconds)
            if access_log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                access_log.info(orjson.dumps({
                    "ts": round(time.time(), 3), "client": f"{client[0]}:{client[1]}" if client else None,
                    "method": scope["method"], "path": scope["path"], "status": status[0],
                    "ms": round(seconds * 1e3, 2), "bytes_in": size[0]}).decode())

    def authorize(self, scope) -> ApiError | None:
        if self.api_key is None or (scope["path"] in OPEN_PATHS and scope["method"] in ("GET", "HEAD")):
            return None
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                        "unauthorized", field="Authorization")

    async def read_body(self, receive) -> tuple[bytes, ApiError | None]:
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                return b"", ApiError(413, f"the request body is larger than the limit of {self.max_body} bytes",
                                     "payload_too_large", field="body", limit=self.max_body)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return b"", ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})", field="body")
        return body, None


def is_json(scope) -> bool:
    """Whether the request says its body is JSON (the direct path takes nothing else)."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then defers to the real one."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped
