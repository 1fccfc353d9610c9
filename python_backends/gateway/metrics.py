"""The gateway's own Prometheus metrics, on its /metrics (docs/metrics.md lists them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from python_backends.gateway.backends import Backend, BackendPool

ENDPOINTS = ("completions", "chat", "generate", "generate_stream")
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "gateway_requests", "Requests by endpoint, the server that answered, its region and "
            "the status (one count per server tried)",
            ["endpoint", "backend", "region", "status"], registry=self.registry)
        self.retries = Counter(
            "gateway_retries", "Requests passed to this server after another failed them "
            "before their first token", ["backend"], registry=self.registry)
        self.migrations = Counter(
            "gateway_migrations", "Streams a server broke mid-way that went on on this server "
            "(the prompt and the tokens so far sent to it)", ["backend"],
            registry=self.registry)
        self.overhead = Histogram(
            "gateway_request_overhead_seconds", "Time from a request's arrival to its hand-off "
            "to a server: parsing, auth, rate limits, templating, routing",
            buckets=OVERHEAD_BUCKETS, registry=self.registry)
        self.healthy = Gauge("gateway_backend_healthy", "1 while the server is in rotation",
                             ["backend", "region"], registry=self.registry)
        self.in_flight = Gauge("gateway_backend_in_flight", "Requests open on the server",
                               ["backend", "region"], registry=self.registry)

    def register(self, pool: BackendPool) -> None:
        """Every server's series from the start, at 0 (a dashboard or an alert on a rate needs
        the series before the first event)."""
        for b in pool.backends.values():
            region = b.config.region
            self.retries.labels(backend=b.name)
            self.migrations.labels(backend=b.name)
            self.healthy.labels(backend=b.name, region=region)
            self.in_flight.labels(backend=b.name, region=region)
            for endpoint in ENDPOINTS:
                self.requests.labels(endpoint=endpoint, backend=b.name, region=region,
                                     status="200")

    def count(self, endpoint: str, backend: Backend | None, status: int) -> None:
        name, region = (backend.name, backend.config.region) if backend else ("none", "none")
        self.requests.labels(endpoint=endpoint, backend=name, region=region,
                             status=str(status)).inc()

    def render(self, pool: BackendPool) -> bytes:
        for view in pool.views():
            self.healthy.labels(backend=view.name, region=view.region).set(int(view.healthy))
            self.in_flight.labels(backend=view.name, region=view.region).set(view.in_flight)
        return generate_latest(self.registry)
