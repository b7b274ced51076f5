"""Prometheus metric names of nitsum (ARCHITECTURE.md) and the /metrics endpoint.

Each service creates only the metrics it updates, on its own registry, from the constructors here, so
every name and label set is written once.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
RECONFIG_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000, 20000)


class Metrics:
    """A registry plus lazily created metrics, keyed by their public names."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        self._made: dict[str, object] = {}

    def _get(self, name: str, factory):
        metric = self._made.get(name)
        if metric is None:
            metric = factory()
            self._made[name] = metric
        return metric

    def get(self, name: str, factory):
        """The metric made under `name` (by `factory`, the first time): a service's own metrics."""
        return self._get(name, factory)

    # request path (gateway and coordinator)
    def requests_total(self) -> Counter:
        return self._get(
            "requests",
            lambda: Counter(
                "nitsum_requests_total", "requests by tier and outcome", ["tier", "outcome"], registry=self.registry
            ),
        )

    def goodput_requests_total(self) -> Counter:
        return self._get(
            "goodput",
            lambda: Counter(
                "nitsum_goodput_requests_total",
                "requests that met both TTFT and TPOT",
                ["tier"],
                registry=self.registry,
            ),
        )

    def ttft_seconds(self) -> Histogram:
        return self._get(
            "ttft",
            lambda: Histogram(
                "nitsum_time_to_first_token_seconds",
                "time to first token",
                ["tier"],
                buckets=LATENCY_BUCKETS_S,
                registry=self.registry,
            ),
        )

    def tpot_seconds(self) -> Histogram:
        return self._get(
            "tpot",
            lambda: Histogram(
                "nitsum_time_per_output_token_seconds",
                "time per output token",
                ["tier"],
                buckets=LATENCY_BUCKETS_S,
                registry=self.registry,
            ),
        )

    def slo_compliance_ratio(self) -> Gauge:
        return self._get(
            "slo",
            lambda: Gauge(
                "nitsum_slo_compliance_ratio",
                "fraction of ended requests (failed, rejected and cancelled included) meeting both SLOs",
                ["tier"],
                registry=self.registry,
            ),
        )

    def queue_depth(self) -> Gauge:
        return self._get(
            "queue", lambda: Gauge("nitsum_queue_depth", "requests waiting, per tier", ["tier"], registry=self.registry)
        )

    # topology
    def current_tp_level(self) -> Gauge:
        return self._get(
            "tp",
            lambda: Gauge(
                "nitsum_current_tp_level", "TP level of the worker's group", ["worker"], registry=self.registry
            ),
        )

    def reconfiguration_duration_ms(self) -> Histogram:
        return self._get(
            "reconf",
            lambda: Histogram(
                "nitsum_reconfiguration_duration_ms",
                "TP change phases",
                ["phase"],
                buckets=RECONFIG_BUCKETS_MS,
                registry=self.registry,
            ),
        )

    def kv_migration_bytes_total(self) -> Counter:
        return self._get(
            "kvmig",
            lambda: Counter("nitsum_kv_migration_bytes_total", "KV bytes moved by TP changes", registry=self.registry),
        )

    # flows
    def flow_permits_total(self) -> Counter:
        return self._get(
            "permits",
            lambda: Counter(
                "nitsum_flow_permits_total",
                "flow permits by stage and level",
                ["stage", "level"],
                registry=self.registry,
            ),
        )

    def flow_bytes_total(self) -> Counter:
        return self._get(
            "flowbytes",
            lambda: Counter(
                "nitsum_flow_bytes_total", "bytes moved by flows, per stage", ["stage"], registry=self.registry
            ),
        )

    # worker
    def aborted_requests_total(self) -> Counter:
        return self._get(
            "aborted",
            lambda: Counter(
                "nitsum_aborted_requests_total", "requests aborted at a worker", ["reason"], registry=self.registry
            ),
        )

    def worker_requests_running(self) -> Gauge:
        return self._get(
            "running",
            lambda: Gauge(
                "nitsum_worker_requests_running", "requests running on the worker", ["worker"], registry=self.registry
            ),
        )

    def kv_blocks_free(self) -> Gauge:
        return self._get(
            "kvfree", lambda: Gauge("nitsum_kv_blocks_free", "free KV blocks", ["worker"], registry=self.registry)
        )

    def generated_tokens_total(self) -> Counter:
        return self._get(
            "gen",
            lambda: Counter(
                "nitsum_generated_tokens_total", "output tokens generated", ["worker"], registry=self.registry
            ),
        )

    # wire
    def dropped_frames_total(self) -> Counter:
        return self._get(
            "dropped",
            lambda: Counter(
                "nitsum_dropped_frames_total", "undecodable frames dropped", ["subject", "code"], registry=self.registry
            ),
        )

    def stream_frames_total(self) -> Counter:
        return self._get(
            "stream_frames",
            lambda: Counter(
                "nitsum_stream_frames_total",
                "token frames a gateway received: kind=batch (TokenBatch, one per worker step) or single (TokenChunk)",
                ["kind"],
                registry=self.registry,
            ),
        )

    # process health (the soak benchmark watches it stay flat)
    def asyncio_tasks(self) -> Gauge:
        return self._get(
            "tasks",
            lambda: Gauge(
                "nitsum_asyncio_tasks", "asyncio tasks alive on the service's event loop", registry=self.registry
            ),
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int, addr: str = "0.0.0.0"):
        """Expose /metrics on its own port (services without an HTTP server). Returns the server or None."""
        if port <= 0:
            return None
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
