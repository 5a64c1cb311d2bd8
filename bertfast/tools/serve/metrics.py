"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Queue depth and requests in flight are read from the batcher when scraped; batches are observed by
the engine thread's hook; requests by the gate (route template as label, never the raw path).
`bertfast_tokens_total` counts tokens run through the model: `rate()` of it is tokens/s.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, batcher):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("bertfast_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("bertfast_request_duration_seconds", "time from request to response",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_tokens = Histogram("bertfast_batch_tokens", "real tokens per model call", buckets=TOKEN_BUCKETS,
                                      registry=r)
        self.batch_rows = Histogram("bertfast_batch_rows", "texts per model call",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.batch_seconds = Histogram("bertfast_batch_duration_seconds", "model call time",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("bertfast_tokens", "tokens run through the model (rate() is tokens/s)", registry=r)
        Gauge("bertfast_queue_depth", "texts queued for the engine thread", registry=r).set_function(
            lambda: batcher.depth)
        Gauge("bertfast_requests_in_flight", "requests accepted and not yet answered", registry=r).set_function(
            lambda: batcher.accepted)

    def on_batch(self, rows: int, tokens: int, seconds: float) -> None:
        """The batcher's hook (engine thread)."""
        self.batch_rows.observe(rows)
        self.batch_tokens.observe(tokens)
        self.batch_seconds.observe(seconds)
        self.tokens.inc(tokens)

    def on_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
