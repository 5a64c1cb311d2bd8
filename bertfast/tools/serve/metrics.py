"""Prometheus metrics of one server (own registry, so several apps can live in one process).

Queue depth and requests in flight are read from the batchers when scraped: the server's totals, and per model
(label `model`); batches are observed by each engine thread's hook (label `model`); requests by the gate (route
template as label, never the raw path). `bertfast_tokens_total` counts tokens run through a model: `rate()` of it
is tokens/s.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, totals):
        """totals: what holds the server's `depth` and `accepted` (the Service)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("bertfast_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("bertfast_request_duration_seconds", "time from request to response",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_tokens = Histogram("bertfast_batch_tokens", "real tokens per model call", ["model"],
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.batch_rows = Histogram("bertfast_batch_rows", "texts per model call", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.batch_seconds = Histogram("bertfast_batch_duration_seconds", "model call time", ["model"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("bertfast_tokens", "tokens run through the model (rate() is tokens/s)", ["model"],
                              registry=r)
        Gauge("bertfast_queue_depth", "texts queued for the engine threads", registry=r).set_function(
            lambda: totals.depth)
        Gauge("bertfast_requests_in_flight", "requests accepted and not yet answered", registry=r).set_function(
            lambda: totals.accepted)
        self.model_depth = Gauge("bertfast_model_queue_depth", "texts queued for a model's engine thread", ["model"],
                                 registry=r)
        self.model_in_flight = Gauge("bertfast_model_requests_in_flight", "a model's requests accepted and not yet "
                                     "answered", ["model"], registry=r)

    def add_model(self, name: str, batcher) -> None:
        """Read `batcher`'s gauges under model=name and observe its batches (its hook runs on its engine thread)."""
        self.model_depth.labels(name).set_function(lambda: batcher.depth)
        self.model_in_flight.labels(name).set_function(lambda: batcher.accepted)
        rows, tokens, seconds, total = (m.labels(name) for m in (self.batch_rows, self.batch_tokens,
                                                                  self.batch_seconds, self.tokens))

        def on_batch(n: int, t: int, s: float) -> None:
            rows.observe(n)
            tokens.observe(t)
            seconds.observe(s)
            total.inc(t)

        batcher.on_batch = on_batch

    def on_request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
