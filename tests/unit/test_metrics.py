"""Metrics: what is counted, what a scrape reads from the coordinators, and the endpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cri_shim.creation.coordinator import CreationCoordinator, Stage
from cri_shim.errors import DeadlineExceeded, NameReserved
from cri_shim.inspection.census import Census
from cri_shim.loop_monitor import LoopMonitor
from cri_shim.metrics import (
    CensusCollector,
    Metrics,
    MetricsEndpoint,
    MetricsExporter,
    split_host_port,
)
from cri_shim.network.cni import CniNetwork, PodNetworkRequest
from cri_shim.runtime.oci import OciRuntime
from cri_shim.server.rpc import cri_method_name, rpc
from tests.waiting import until


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, frozenset(s.labels.items()))] = s.value
    return found


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return samples(generate_latest(metrics.registry).decode()).get(
        (name, frozenset(labels.items()))
    )


# ---- counted as it happens ----------------------------------------------------------


def test_rpcs_are_counted_by_method_and_code_with_latency() -> None:
    metrics = Metrics()
    metrics.observe_rpc("RunPodSandbox", "OK", 0.2)
    metrics.observe_rpc("RunPodSandbox", "DEADLINE_EXCEEDED", 1.5)
    metrics.observe_rpc("RunPodSandbox", "OK", 0.3)
    name = "cri_shim_rpc_requests_total"
    assert value(metrics, name, method="RunPodSandbox", code="OK") == 2
    assert value(metrics, name, method="RunPodSandbox", code="DEADLINE_EXCEEDED") == 1
    count = "cri_shim_rpc_duration_seconds_count"
    assert value(metrics, count, method="RunPodSandbox") == 3
    assert value(metrics, "cri_shim_rpc_duration_seconds_sum", method="RunPodSandbox") == 2.0


@pytest.mark.parametrize(
    ("handler", "method"),
    [
        ("run_pod_sandbox", "RunPodSandbox"),
        ("version", "Version"),
        ("image_fs_info", "ImageFsInfo"),
        ("ListPodSandbox", "ListPodSandbox"),
        ("exec_", "Exec"),
    ],
)
def test_rpcs_are_named_as_the_cri_names_them(handler: str, method: str) -> None:
    assert cri_method_name(handler) == method

    async def fake_handler(services: Any, request: Any, context: Any) -> None:
        return None

    fake_handler.__name__ = handler
    assert rpc(fake_handler).__name__ == method


def test_tool_calls_are_counted_by_tool_op_and_result_with_latency() -> None:
    metrics = Metrics()
    metrics.observe_call("cni", "ADD bridge", 0.03, True)
    metrics.observe_call("cni", "ADD bridge", 4.0, False)
    calls = "cri_shim_host_calls_total"
    assert value(metrics, calls, tool="cni", op="ADD bridge", result="ok") == 1
    assert value(metrics, calls, tool="cni", op="ADD bridge", result="error") == 1
    bucket = "cri_shim_host_call_duration_seconds_bucket"
    assert value(metrics, bucket, tool="cni", op="ADD bridge", le="0.05") == 1


async def test_the_oci_runtime_reports_each_call(tmp_path: Path) -> None:
    sink = Metrics()
    fake = tmp_path / "fake-runc"
    # Succeeds for `start`, fails like runc for anything else.
    fake.write_text(
        '#!/bin/sh\ncase " $* " in *" start "*) exit 0;; esac\n'
        'echo "container does not exist" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    runtime = OciRuntime(
        fake, tmp_path / "root", log_dir=tmp_path / "logs", observe_call=sink.observe_call
    )
    await runtime.start("c1")
    with pytest.raises(Exception):  # noqa: B017 - the classification is oci's business
        await runtime.kill("c1", 9)
    calls = "cri_shim_host_calls_total"
    assert value(sink, calls, tool="fake-runc", op="start", result="ok") == 1
    assert value(sink, calls, tool="fake-runc", op="kill", result="error") == 1


async def test_the_cni_runner_reports_each_plugin_call(tmp_path: Path) -> None:
    sink = Metrics()
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "net.d"
    bin_dir.mkdir()
    conf_dir.mkdir()
    result = {"cniVersion": "1.0.0", "ips": [{"address": "10.9.0.2/24"}]}
    plugin = bin_dir / "fake"
    plugin.write_text(f"#!/bin/sh\ncat > /dev/null\necho '{json.dumps(result)}'\n")
    plugin.chmod(0o755)
    conf = {"cniVersion": "1.0.0", "name": "t", "plugins": [{"type": "fake"}]}
    (conf_dir / "10-t.conflist").write_text(json.dumps(conf))
    cni = CniNetwork(conf_dir, [bin_dir], None, observe_call=sink.observe_call)
    request = PodNetworkRequest("p1", tmp_path / "netns", "web", "default", "uid-1")
    assert (await cni.add(request, 10)).ips == ["10.9.0.2"]
    await cni.delete(request, 10)
    calls = "cri_shim_host_calls_total"
    assert value(sink, calls, tool="cni", op="ADD fake", result="ok") == 1
    assert value(sink, calls, tool="cni", op="DEL fake", result="ok") == 1


# ---- read at scrape time --------------------------------------------------------------


class NoHooks:
    """Coordinator hooks that persist nothing: the collector only reads stats()."""

    def reserve(self, name: str, object_id: str) -> None: ...
    def stage_changed(self, object_id: str, stage: str) -> None: ...
    def cached(self, object_id: str, expires_at: float) -> None: ...
    def publish(self, object_id: str) -> None: ...
    async def cleanup(self, object_id: str) -> None: ...
    def released(self, name: str, object_id: str) -> None: ...


@dataclass
class FakeObjects:
    """A lifecycle as the census reads it: a coordinator and visible objects' states."""

    coordinator: CreationCoordinator
    states: list[str] = field(default_factory=list)

    def list(self) -> list[Any]:
        return [SimpleNamespace(state=s) for s in self.states]


@dataclass
class FakeDaemon:
    metrics: Metrics = field(default_factory=Metrics)
    sandboxes: FakeObjects = field(
        default_factory=lambda: FakeObjects(CreationCoordinator("sandbox", NoHooks()))
    )
    containers: FakeObjects = field(
        default_factory=lambda: FakeObjects(CreationCoordinator("container", NoHooks()))
    )
    loop_monitor: LoopMonitor | None = None

    @property
    def census(self) -> Census:
        return Census(self.sandboxes, self.containers, self.loop_monitor)

    def collected(self) -> FakeDaemon:
        self.metrics.registry.register(CensusCollector(self.census))
        return self


def scrape(services: FakeDaemon) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return samples(generate_latest(services.metrics.registry).decode())


def creation(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, frozenset({"kind": "sandbox", **labels}.items())))


async def test_a_scrape_follows_the_three_request_protocol() -> None:
    services = FakeDaemon().collected()
    coordinator = services.sandboxes.coordinator
    loop = asyncio.get_running_loop()
    network_done = asyncio.Event()

    async def slow_network(object_id: str, stage: Stage) -> None:
        stage.set("sandbox network")
        await network_done.wait()

    with pytest.raises(DeadlineExceeded):
        await coordinator.create("k8s_POD_web", loop.time() + 0.05, slow_network)
    with pytest.raises(NameReserved):
        await coordinator.create("k8s_POD_web", loop.time() + 0.05, slow_network)
    await asyncio.sleep(0.1)  # the stage has lasted 0.1 s more than both requests' waits
    during = scrape(services)
    assert creation(during, "cri_shim_creation_stalled", stage="sandbox network") == 1
    age = creation(during, "cri_shim_creation_stage_age_max_seconds", stage="sandbox network")
    assert age is not None and age >= 0.1
    assert creation(during, "cri_shim_creation_objects", phase="in_flight") == 1
    assert creation(during, "cri_shim_creation_events_total", event="name_reserved") == 1
    assert creation(during, "cri_shim_creation_events_total", event="claimed") == 0

    network_done.set()
    # The creation finishes into the cache.
    await until(lambda: creation(scrape(services), "cri_shim_creation_objects", phase="cached"))
    cached = scrape(services)
    assert creation(cached, "cri_shim_creation_objects", phase="cached") == 1
    assert creation(cached, "cri_shim_creation_stalled", stage="sandbox network") is None
    object_id = await coordinator.create("k8s_POD_web", loop.time() + 1, slow_network)
    assert object_id

    after = scrape(services)
    events = "cri_shim_creation_events_total"
    for event, count in [
        ("reserved", 1),
        ("timed_out", 1),
        ("waiting", 1),
        ("name_reserved", 1),
        ("cached", 1),
        ("claimed", 1),
        ("expired", 0),
    ]:
        assert creation(after, events, event=event) == count, event
    assert creation(after, "cri_shim_creation_objects", phase="visible") == 1
    entered = "cri_shim_creation_stages_entered_total"
    assert creation(after, entered, stage="sandbox network") == 1
    # The stage lasted until network_done was set: its time is counted once it ended.
    assert creation(after, "cri_shim_creation_stage_seconds_total", stage="sandbox network") > 0
    await coordinator.aclose()


async def test_objects_are_counted_by_state_with_zeros_for_the_rest() -> None:
    # Async: the coordinators' stats() read the event loop's clock, as scrapes do in the daemon.
    services = FakeDaemon()
    services.sandboxes.states = ["ready", "ready", "notready"]
    services.containers.states = ["running", "exited", "running"]
    services.collected()
    found = scrape(services)
    assert found[("cri_shim_sandboxes", frozenset({("state", "ready")}))] == 2
    assert found[("cri_shim_sandboxes", frozenset({("state", "notready")}))] == 1
    assert found[("cri_shim_containers", frozenset({("state", "running")}))] == 2
    assert found[("cri_shim_containers", frozenset({("state", "created")}))] == 0
    assert found[("cri_shim_containers", frozenset({("state", "unknown")}))] == 0


async def test_the_event_loops_lag_is_a_histogram() -> None:
    monitor = LoopMonitor(0.1)
    for lag in (0.0005, 0.02, 0.3):
        monitor.record(lag)
    services = FakeDaemon(loop_monitor=monitor).collected()
    found = scrape(services)
    bucket = "cri_shim_event_loop_lag_seconds_bucket"
    assert found[(bucket, frozenset({("le", "0.001")}))] == 1
    assert found[(bucket, frozenset({("le", "0.1")}))] == 2
    assert found[(bucket, frozenset({("le", "+Inf")}))] == 3
    assert found[("cri_shim_event_loop_lag_seconds_count", frozenset())] == 3
    assert found[("cri_shim_event_loop_lag_seconds_sum", frozenset())] == pytest.approx(0.3205)


# ---- the endpoint -------------------------------------------------------------------


async def http(address: tuple[str, int], request: bytes) -> tuple[str, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection(*address)
    writer.write(request)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return status, headers, body


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[Metrics, MetricsEndpoint]]:
    metrics = Metrics()
    server = MetricsEndpoint(metrics.registry, "127.0.0.1:0")
    await server.start()
    yield metrics, server
    await server.aclose()


async def test_endpoint_serves_prometheus_text(endpoint: tuple[Metrics, MetricsEndpoint]) -> None:
    metrics, server = endpoint
    metrics.observe_rpc("Version", "OK", 0.001)
    status, headers, body = await http(server.address, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == "HTTP/1.1 200 OK"
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(headers["content-length"]) == len(body)
    found = samples(body.decode())
    assert (
        found[("cri_shim_rpc_requests_total", frozenset({("method", "Version"), ("code", "OK")}))]
        == 1
    )


async def test_endpoint_speaks_openmetrics_when_asked(
    endpoint: tuple[Metrics, MetricsEndpoint],
) -> None:
    _, server = endpoint
    request = (
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n"
    )
    _, headers, body = await http(server.address, request)
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


async def test_endpoint_answers_other_requests_plainly(
    endpoint: tuple[Metrics, MetricsEndpoint],
) -> None:
    _, server = endpoint
    status, headers, body = await http(server.address, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == "HTTP/1.1 200 OK" and body == b"" and int(headers["content-length"]) > 0
    assert (await http(server.address, b"GET /nope HTTP/1.1\r\n\r\n"))[0].endswith("404 Not Found")
    assert (await http(server.address, b"POST /metrics HTTP/1.1\r\n\r\n"))[0].endswith(
        "405 Method Not Allowed"
    )
    assert (await http(server.address, b"nonsense\r\n\r\n"))[0].endswith("400 Bad Request")
    assert b"/metrics" in (await http(server.address, b"GET / HTTP/1.1\r\n\r\n"))[2]


async def test_closing_stops_listening_and_drops_idle_connections() -> None:
    server = MetricsEndpoint(Metrics().registry, "127.0.0.1:0")
    await server.start()
    address = server.address
    # A scraper that connected and never finished its request must not hold the stop up.
    _, idle = await asyncio.open_connection(*address)
    idle.write(b"GET /metr")
    await until(lambda: server._connections)  # the server is reading that request
    await asyncio.wait_for(server.aclose(), 2)
    idle.close()
    with pytest.raises(OSError):
        await asyncio.open_connection(*address)


async def test_a_busy_port_is_reported_with_the_key() -> None:
    first = MetricsEndpoint(Metrics().registry, "127.0.0.1:0")
    await first.start()
    try:
        second = MetricsEndpoint(Metrics().registry, f"127.0.0.1:{first.address[1]}")
        with pytest.raises(OSError, match=r"metrics\.listen 127\.0\.0\.1:"):
            await second.start()
    finally:
        await first.aclose()


async def test_exporter_registers_the_census_and_unregisters_it() -> None:
    services = FakeDaemon()
    services.sandboxes.states = ["ready"]
    exporter = MetricsExporter(services.census, services.metrics, "")
    assert exporter.endpoint is None  # off by default
    await exporter.start()
    try:
        found = scrape(services)
        assert found[("cri_shim_sandboxes", frozenset({("state", "ready")}))] == 1
    finally:
        await exporter.aclose()
    assert ("cri_shim_sandboxes", frozenset({("state", "ready")})) not in scrape(services)


@pytest.mark.parametrize(
    ("listen", "expected"),
    [
        ("127.0.0.1:9090", ("127.0.0.1", 9090)),
        ("[::1]:9090", ("::1", 9090)),
        (":9090", (None, 9090)),
        ("node1:0", ("node1", 0)),
    ],
)
def test_split_host_port(listen: str, expected: tuple[str | None, int]) -> None:
    assert split_host_port(listen) == expected
