"""Prometheus metrics of the daemon, and the endpoint that serves them (`[metrics] listen`).

Three sources, each counted once, where it happens:
- RPCs: `Metrics.observe_rpc`, called by the gRPC edge for every request (count by status
  code, latency histogram by method).
- External tools: `Metrics.observe_call`, handed by the composition root to the CNI runner
  and the OCI runtime wrapper, for every plugin / runtime process (latency histogram,
  count by result).
- Creation and objects: `CensusCollector` reads the census (inspection/census.py: the
  creation coordinators' `stats()`, the visible sandboxes and containers, the event
  loop's lag) *at scrape time*, so the coordinators stay the only bookkeeping of `name is
  reserved` answers, claims, expiries and stalled creations.

The endpoint is a small asyncio HTTP server on the daemon's event loop rather than
prometheus_client's thread: collection then runs on the loop that owns the coordinators
(whose stats() read the loop's clock) and the database connection, so a scrape never
races a request.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from cri_shim.creation.statistics import CreationStats
    from cri_shim.inspection.census import Census

log = logging.getLogger("cri_shim.metrics")

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
# Every state a visible object can be in, so that a scrape shows zeros rather than no series.
SANDBOX_STATES = ("ready", "notready")
CONTAINER_STATES = ("created", "running", "exited", "unknown")


class Metrics:
    """The daemon's registry and the metrics that are counted as events happen.

    Made only when `[metrics] listen` is set: prometheus_client is imported here, so that
    a daemon that exports nothing does not carry it (about 4 MiB).
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.rpc_requests = Counter(
            "cri_shim_rpc_requests",
            "CRI requests by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.rpc_latency = Histogram(
            "cri_shim_rpc_duration_seconds",
            "CRI request latency by method",
            ["method"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.host_calls = Counter(
            "cri_shim_host_calls",
            "Calls of external tools (tool=cni: op is 'COMMAND plugin'; tool=runc/crun: op is "
            "the runtime verb) by result",
            ["tool", "op", "result"],
            registry=self.registry,
        )
        self.host_call_latency = Histogram(
            "cri_shim_host_call_duration_seconds",
            "Latency of external tool calls",
            ["tool", "op"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )

        # The labelled children, looked up once each: `labels()` takes a lock, checks and
        # joins its arguments, and every CRI call would pay that twice.
        self._rpc_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._call_children: dict[tuple[str, str, bool], tuple[Any, Any]] = {}

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        """`method` as the CRI (and crictl) names it: `RunPodSandbox`."""
        children = self._rpc_children.get((method, code))
        if children is None:
            children = (self.rpc_requests.labels(method, code), self.rpc_latency.labels(method))
            self._rpc_children[method, code] = children
        children[0].inc()
        children[1].observe(seconds)

    def observe_call(self, tool: str, op: str, seconds: float, ok: bool) -> None:
        children = self._call_children.get((tool, op, ok))
        if children is None:
            result = "ok" if ok else "error"
            children = (
                self.host_calls.labels(tool, op, result),
                self.host_call_latency.labels(tool, op),
            )
            self._call_children[tool, op, ok] = children
        children[0].inc()
        children[1].observe(seconds)


class CensusCollector:
    """Creation counters, stalled creations, objects by state and the event loop's lag,
    read from the census at scrape time."""

    def __init__(self, census: Census) -> None:
        self._census = census

    def collect(self) -> Iterator[Metric]:
        yield from _creation_families(self._census.creation_stats())
        yield from _object_families(self._census)
        monitor = self._census.loop_monitor
        if monitor is not None:
            from prometheus_client.core import HistogramMetricFamily

            lag = HistogramMetricFamily(
                "cri_shim_event_loop_lag_seconds",
                "How late the event loop ran a task that was due, sampled every "
                "[metrics] event_loop_sample_interval: how long a request arriving then waited",
            )
            lag.add_metric([], monitor.cumulative(), monitor.total_lag)
            yield lag


def _creation_families(by_kind: dict[str, CreationStats]) -> list[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    events = CounterMetricFamily(
        "cri_shim_creation_events",
        "Creation events by kind: reserved, created, timed_out, cached, claimed (a retry "
        "took a cached object), handed_off (a waiting duplicate got the finished object), "
        "name_reserved (a duplicate was told `name is reserved`), "
        "expired, failed, released, ...",
        labels=["kind", "event"],
    )
    entered = CounterMetricFamily(
        "cri_shim_creation_stages_entered",
        "Creation stages entered, by kind and stage",
        labels=["kind", "stage"],
    )
    stage_seconds = CounterMetricFamily(
        "cri_shim_creation_stage_seconds",
        "Seconds spent in each creation stage by creations that left it; divided by "
        "cri_shim_creation_stages_entered_total, the average duration of a stage",
        labels=["kind", "stage"],
    )
    stalled = GaugeMetricFamily(
        "cri_shim_creation_stalled",
        "Creations in flight, by the stage they are at",
        labels=["kind", "stage"],
    )
    stage_age = GaugeMetricFamily(
        "cri_shim_creation_stage_age_max_seconds",
        "The longest time an in-flight creation has been at its current stage",
        labels=["kind", "stage"],
    )
    phases = GaugeMetricFamily(
        "cri_shim_creation_objects",
        "Objects held by the creation coordinator, by phase (in_flight and cached ones "
        "are invisible to List and Status)",
        labels=["kind", "phase"],
    )
    for kind, stats in by_kind.items():
        for event, count in sorted(stats["counters"].items()):
            events.add_metric([kind, event], count)
        for stage, count in sorted(stats["stages_entered"].items()):
            entered.add_metric([kind, stage], count)
        for stage, seconds in sorted(stats["stage_seconds"].items()):
            stage_seconds.add_metric([kind, stage], seconds)
        for stage, count in sorted(stats["stalled_by_stage"].items()):
            stalled.add_metric([kind, stage], count)
        oldest: dict[str, float] = {}
        for info in stats["in_flight"]:
            oldest[info["stage"]] = max(oldest.get(info["stage"], 0.0), info["stage_seconds"])
        for stage, seconds in sorted(oldest.items()):
            stage_age.add_metric([kind, stage], seconds)
        phases.add_metric([kind, "in_flight"], len(stats["in_flight"]))
        for phase in ("cached", "visible", "cleaning"):
            phases.add_metric([kind, phase], stats[phase])
    return [events, entered, stage_seconds, stalled, stage_age, phases]


def _object_families(census: Census) -> list[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    sandboxes = GaugeMetricFamily(
        "cri_shim_sandboxes", "Visible pod sandboxes by state", labels=["state"]
    )
    by_state = census.sandboxes_by_state()
    for state in sorted(set(SANDBOX_STATES) | set(by_state)):
        sandboxes.add_metric([state], by_state[state])
    containers = GaugeMetricFamily(
        "cri_shim_containers", "Visible containers by state", labels=["state"]
    )
    by_state = census.containers_by_state()
    for state in sorted(set(CONTAINER_STATES) | set(by_state)):
        containers.add_metric([state], by_state[state])
    return [sandboxes, containers]


_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:]*)):(?P<port>\d+)$")
_MAX_REQUEST_HEAD = 16 * 1024
_REQUEST_TIMEOUT = 10.0


def split_host_port(listen: str) -> tuple[str | None, int]:
    """`127.0.0.1:9090` → ("127.0.0.1", 9090); `[::1]:9090` → ("::1", 9090); `:9090` →
    (None, 9090), every address."""
    match = _HOST_PORT.match(listen)
    if match is None:
        raise ValueError(f"metrics.listen: expected host:port, got {listen!r}")
    host = match.group("v6") or match.group("host") or None
    return host, int(match.group("port"))


class MetricsEndpoint:
    """`GET /metrics` in the Prometheus text format (or OpenMetrics, if asked), on the loop."""

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        self._registry = registry
        self._listen = listen
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port when `listen` asked for port 0)."""
        assert self._server is not None and self._server.sockets
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        host, port = split_host_port(self._listen)
        try:
            self._server = await asyncio.start_server(
                self._serve_connection, host, port, limit=_MAX_REQUEST_HEAD
            )
        except OSError as exc:
            raise OSError(exc.errno, f"metrics.listen {self._listen}: {exc.strerror}") from exc
        log.info("serving metrics on http://%s:%d/metrics", *self.address)

    async def aclose(self) -> None:
        if self._server is None:
            return
        self._server.close()
        # Connections are owned here: a scraper that holds one open must not delay the stop.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
                status, headers, body = self._respond(head)
                if head.startswith(b"HEAD "):
                    # The headers of GET, Content-Length included, and no body.
                    writer.write(_response(status, headers, body).partition(b"\r\n\r\n")[0])
                    writer.write(b"\r\n\r\n")
                else:
                    writer.write(_response(status, headers, body))
                await writer.drain()
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ConnectionError,
        ):
            pass  # the scraper went away or sent garbage; nothing to answer
        finally:
            self._connections.discard(task)
            writer.close()

    def _respond(self, head: bytes) -> tuple[str, dict[str, str], bytes]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return "400 Bad Request", {}, b"bad request\n"
        method, target, _ = parts
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", {"Allow": "GET, HEAD"}, b"method not allowed\n"
        path = target.split("?", 1)[0]
        if path == "/":
            body = b"cri-shim: Prometheus metrics at /metrics\n"
            return "200 OK", {"Content-Type": "text/plain; charset=utf-8"}, body
        if path != "/metrics":
            return "404 Not Found", {}, b"not found; try /metrics\n"
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self._registry)
        except Exception:
            log.exception("collecting metrics failed")
            return "500 Internal Server Error", {}, b"collecting metrics failed\n"
        return "200 OK", {"Content-Type": content_type}, body


def _response(status: str, headers: dict[str, str], body: bytes) -> bytes:
    headers = {"Content-Type": "text/plain; charset=utf-8", **headers}
    headers["Content-Length"] = str(len(body))
    headers["Connection"] = "close"
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


class MetricsExporter:
    """The daemon's metrics wiring: the census collector and the endpoint; closed with the
    daemon."""

    def __init__(self, census: Census, metrics: Metrics, listen: str) -> None:
        self._metrics = metrics
        self._collector = CensusCollector(census)
        self.endpoint = MetricsEndpoint(metrics.registry, listen) if listen else None

    async def start(self) -> None:
        self._metrics.registry.register(self._collector)
        if self.endpoint is not None:
            await self.endpoint.start()

    async def aclose(self) -> None:
        if self.endpoint is not None:
            await self.endpoint.aclose()
        self._metrics.registry.unregister(self._collector)
