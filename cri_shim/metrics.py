"""Prometheus metrics of the daemon (served when `[metrics] listen` is set)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rpc_requests = Counter(
            "cri_shim_rpc_requests", "CRI requests by method and status code",
            ["method", "code"], registry=self.registry,
        )
        self.rpc_latency = Histogram(
            "cri_shim_rpc_duration_seconds", "CRI request latency by method",
            ["method"], registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_requests.labels(method, code).inc()
        self.rpc_latency.labels(method).observe(seconds)
