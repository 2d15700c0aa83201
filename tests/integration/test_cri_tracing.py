"""Traces exported over OTLP/HTTP to a real receiver in the test process.

The receiver decodes each POST to /v1/traces as an `ExportTraceServiceRequest` (the
OpenTelemetry protocol's own message), so what is checked is what a collector such as
Jaeger, Tempo or the OpenTelemetry Collector would receive.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.server
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.collectors import handshake_never_ends, never_answers, self_signed, tls_collector
from tests.harness import CniTestNetwork, Daemon, pod_config, wait_until
from tests.imagebuild import build_image
from tests.nri_plugin import PluginThread, RecordingPlugin
from tests.registry import start_registry

pytest.importorskip("opentelemetry.proto", reason="needs opentelemetry-proto (test extras)")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

pytestmark = [pytest.mark.integration, pytest.mark.root]

STATUS_ERROR = trace_pb2.Status.STATUS_CODE_ERROR


@dataclass
class Receiver:
    """An OTLP/HTTP trace endpoint: every span it was sent, decoded."""

    url: str
    spans: list[trace_pb2.Span] = field(default_factory=list)
    services: set[str] = field(default_factory=set)

    def named(self, name: str) -> list[trace_pb2.Span]:
        return [s for s in self.spans if s.name == name]

    def by_id(self, span_id: bytes) -> trace_pb2.Span:
        (found,) = [s for s in self.spans if s.span_id == span_id]
        return found

    def children(self, parent: trace_pb2.Span) -> list[trace_pb2.Span]:
        return [
            s
            for s in self.spans
            if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id
        ]


@contextlib.contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    lock = threading.Lock()
    receiver = Receiver(url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
            with lock:
                for resource_spans in request.resource_spans:
                    for attribute in resource_spans.resource.attributes:
                        if attribute.key == "service.name":
                            receiver.services.add(attribute.value.string_value)
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()


def attributes(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        out[attribute.key] = getattr(value, value.WhichOneof("value"))
    return out


def traceparent() -> tuple[str, bytes, bytes]:
    """A sampled W3C traceparent as kubelet sends it, with its trace and span IDs."""
    trace_id, span_id = os.urandom(16), os.urandom(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


def run_pod(daemon: Daemon, name: str, timeout: float, parent: str) -> str:
    return (
        daemon.runtime()
        .RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=pod_config(name)),
            timeout=timeout,
            metadata=(("traceparent", parent),),
        )
        .pod_sandbox_id
    )


def test_a_retried_creation_is_one_trace_linked_from_each_request(
    short_tmp: Any, test_network: CniTestNetwork
) -> None:
    """kubelet's first RunPodSandbox times out on a slow CNI plugin; its retry waits on the
    creation and is handed the pod. Each request's span is a child of the traceparent it
    carried, and both link to one creation trace whose network stage holds the slow ADD."""
    with otlp_receiver() as receiver:
        daemon = Daemon(short_tmp, test_network, settings={"tracing": {"endpoint": receiver.url}})
        daemon.start()
        try:
            first_parent, first_trace, first_span = traceparent()
            second_parent, second_trace, second_span = traceparent()
            pool = concurrent.futures.ThreadPoolExecutor(1)
            with test_network.held():
                with pytest.raises(grpc.RpcError) as timed_out:
                    run_pod(daemon, "traced", 4, first_parent)
                assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                retry = pool.submit(run_pod, daemon, "traced", 60, second_parent)
                wait_until(
                    lambda: (
                        sum(c["watchers"] for c in daemon.creations("sandbox")["in_flight"]) == 1
                    ),
                    timeout=30,
                )
            sandbox_id = retry.result(timeout=60)
            pool.shutdown()

            def exported() -> bool:
                return (
                    any(attributes(s).get("cri.creation.outcome") for s in receiver.spans)
                    and len(receiver.named("runtime.v1.RunPodSandbox")) == 2
                )

            wait_until(exported, timeout=30)
            requests = {s.trace_id: s for s in receiver.named("runtime.v1.RunPodSandbox")}
            first, second = requests[first_trace], requests[second_trace]
            # Children of what each request carried.
            assert first.parent_span_id == first_span
            assert second.parent_span_id == second_span
            assert first.status.code == STATUS_ERROR
            assert (
                attributes(first)["rpc.grpc.status_code"]
                == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            )
            assert attributes(second)["rpc.grpc.status_code"] == 0
            assert attributes(second)["cri.sandbox_id"] == sandbox_id
            # Both link to the one creation, a trace of its own.
            (root,) = [s for s in receiver.named("sandbox creation")]
            assert root.trace_id not in (first_trace, second_trace)
            for request in (first, second):
                assert [(link.trace_id, link.span_id) for link in request.links] == [
                    (root.trace_id, root.span_id)
                ]
            root_attributes = attributes(root)
            assert root_attributes["cri.sandbox_id"] == sandbox_id
            assert root_attributes["cri.creation.requests"] == 2
            assert root_attributes["cri.creation.requests_served"] == 1
            assert root_attributes["cri.creation.outcome"] == "visible"
            # What happened to each request there.
            first_events = [e.name for e in first.events]
            assert first_events[0] == "started the creation"
            assert first_events[-1].startswith("deadline passed; the creation goes on")
            assert [e.name for e in second.events] == [
                "waited on the creation at stage sandbox network",
                "handed the finished object",
            ]
            # The stages as the journal ran them, the held CNI ADD inside the network's.
            stages = {s.name: s for s in receiver.children(root)}
            assert "sandbox namespaces" in stages and "sandbox network" in stages
            network = stages["sandbox network"]
            plugins = {s.name: s for s in receiver.children(network)}
            assert {"CNI ADD bridge", "CNI ADD slow-cni"} <= set(plugins)
            held = plugins["CNI ADD slow-cni"]
            # It was still running when the first request gave up, and ended before the
            # retry was answered.
            assert held.start_time_unix_nano < first.end_time_unix_nano < held.end_time_unix_nano
            assert held.end_time_unix_nano < second.end_time_unix_nano
            assert receiver.services == {"cri-shim"}
            # Logs join traces: the request's lines carry its trace ID.
            log = daemon.log_path.read_text()
            assert f"trace_id={first_trace.hex()}" in log
            assert f"trace_id={root.trace_id.hex()}" in log
            # Teardown: each undo step a span under the call that ran it.
            stop_parent, stop_trace, _ = traceparent()
            daemon.runtime().StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                timeout=30,
                metadata=(("traceparent", stop_parent),),
            )
            remove_parent, remove_trace, _ = traceparent()
            daemon.runtime().RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                timeout=30,
                metadata=(("traceparent", remove_parent),),
            )

            def undone(trace_id: bytes) -> set[str]:
                return {
                    s.name
                    for s in receiver.spans
                    if s.trace_id == trace_id and s.name.startswith("undo ")
                }

            wait_until(lambda: "undo cni_del" in undone(stop_trace), timeout=30)
            wait_until(lambda: "undo remove_dir" in undone(remove_trace), timeout=30)
        finally:
            daemon.stop()


def test_an_unsampled_caller_is_not_traced(short_tmp: Any) -> None:
    """Parent-based sampling: a traceparent that says 'not sampled' is followed."""
    with otlp_receiver() as receiver:
        daemon = Daemon(short_tmp, None, settings={"tracing": {"endpoint": receiver.url}})
        daemon.start()
        try:
            trace_id, span_id = os.urandom(16).hex(), os.urandom(8).hex()
            daemon.runtime().Version(
                api_pb2.VersionRequest(),
                timeout=10,
                metadata=(("traceparent", f"00-{trace_id}-{span_id}-00"),),
            )
            daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)  # a root: sampled
            # The sampled root ended after the unsampled call: once it is exported, so
            # would the other have been.
            wait_until(lambda: len(receiver.named("runtime.v1.Version")) >= 1, timeout=30)
            assert trace_id not in {s.trace_id.hex() for s in receiver.spans}
        finally:
            daemon.stop()


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A collector that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        listener.close()


def test_a_dead_collector_costs_a_bounded_queue_and_a_counter(short_tmp: Any) -> None:
    """Spans for a collector that never answers wait in a bounded queue and are dropped
    and counted beyond it; calls are answered all the same, and the daemon stops."""
    with black_hole() as endpoint:
        daemon = Daemon(
            short_tmp,
            None,
            settings={
                "tracing": {
                    "endpoint": endpoint,
                    "max_queued_spans": 20,
                    "export_timeout": "60s",
                }
            },
        )
        daemon.start()
        try:
            for _ in range(300):
                daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)
            figures = daemon.status_info()["tracing"]
            assert figures["queued"] <= 20
            assert figures["exported"] == 0
            assert figures["dropped"] >= 300 - 2 * 20
        finally:
            # A stop waits for the stuck export a bounded time, then exits cleanly.
            assert daemon.stop() == 0


def test_a_pull_traces_its_layer_downloads_and_unpacks(short_tmp: Any) -> None:
    registry = start_registry(short_tmp / "registry")
    try:
        image = build_image(extra_files={"etc/which": b"traced"})
        registry.push("team/traced", image, "v1")
        with otlp_receiver() as receiver:
            daemon = Daemon(
                short_tmp,
                None,
                settings={
                    "tracing": {"endpoint": receiver.url},
                    "images": {"insecure_registries": [registry.host]},
                },
            )
            daemon.start()
            try:
                daemon.images().PullImage(
                    api_pb2.PullImageRequest(
                        image=api_pb2.ImageSpec(image=f"{registry.host}/team/traced:v1")
                    ),
                    timeout=120,
                )
                wait_until(lambda: receiver.named("runtime.v1.PullImage"), timeout=30)
                (pull,) = receiver.named("runtime.v1.PullImage")
                under = [s for s in receiver.spans if s.trace_id == pull.trace_id]
                downloads = [s for s in under if s.name == "layer download"]
                unpacks = [s for s in under if s.name == "layer unpack"]
                assert len(downloads) == len(image.layers) == len(unpacks)
                assert {attributes(s)["oci.layer.digest"] for s in downloads} == {
                    layer.digest for layer in image.layers
                }
            finally:
                daemon.stop()
    finally:
        registry.stop()


def test_each_nri_plugin_call_is_a_span_of_the_creation_stage(
    short_tmp: Any, test_network: CniTestNetwork
) -> None:
    with otlp_receiver() as receiver:
        daemon = Daemon(
            short_tmp,
            test_network,
            settings={
                "tracing": {"endpoint": receiver.url},
                "nri": {"enable": True, "socket_path": str(short_tmp / "nri.sock")},
            },
        )
        daemon.start()
        thread = PluginThread(RecordingPlugin(), short_tmp / "nri.sock")
        plugin = thread.start()
        try:
            wait_until(lambda: "Synchronize" in plugin.methods, timeout=30)
            sandbox_id = run_pod(daemon, "nri-traced", 60, traceparent()[0])
            wait_until(lambda: receiver.named("sandbox NRI plugins"), timeout=30)
            (stage,) = receiver.named("sandbox NRI plugins")
            calls = [s.name for s in receiver.children(stage)]
            assert calls == [f"NRI RunPodSandbox {plugin.index}-{plugin.name}"]
            daemon.runtime().StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
            )
            daemon.runtime().RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
            )
        finally:
            thread.stop()
            daemon.stop()


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
        / 1024
    )


class HostileCollector:
    """Answers 200 to every export, then `mode` says what: "endless" sends body bytes as
    fast as the daemon takes them (at most `endless_bytes` per export), "trickle" one byte
    every `trickle_every` seconds; "good" answers as a collector does (spans in `good`).
    `exchanges` holds how long each connection lasted, as the collector saw it."""

    def __init__(self) -> None:
        self.mode = "endless"
        self.endless_bytes = 400 << 20
        self.trickle_every = 0.2
        self.exchanges: list[tuple[str, float]] = []
        self.good = Receiver(url="")
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        began, mode = time.monotonic(), self.mode
        with connection, contextlib.suppress(OSError):
            connection.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = connection.recv(65536)
                if not chunk:
                    return
                head += chunk
            header, _, body = head.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", header).group(1))  # type: ignore[union-attr]
            while len(body) < length:
                body += connection.recv(length - len(body))
            if mode == "good":
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        self.good.spans.extend(scope_spans.spans)
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                return
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n")
            if mode == "endless":
                connection.sendall(b"\r\n")
                block, sent = b"\0" * (1 << 20), 0
                while sent < self.endless_bytes and not self._stop.is_set():
                    connection.sendall(block)
                    sent += len(block)
                connection.settimeout(60)
                connection.recv(1)  # held open until the daemon hangs up
            else:
                while not self._stop.is_set():
                    connection.sendall(b"X")
                    time.sleep(self.trickle_every)
        self.exchanges.append((mode, time.monotonic() - began))

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(10)


def test_a_hostile_collector_costs_neither_memory_nor_stuck_exports(short_tmp: Any) -> None:
    """What answers at `[tracing] endpoint` may send an endless body or trickle a byte at
    a time: the daemon reads a bounded answer within `export_timeout` for the whole
    exchange, counts the export failed, and goes on exporting to a collector that
    behaves."""
    collector = HostileCollector()
    daemon = Daemon(
        short_tmp,
        None,
        settings={"tracing": {"endpoint": collector.url, "export_timeout": "2s"}},
    )
    daemon.start()
    try:
        assert daemon.proc is not None
        before = rss_mib(daemon.proc.pid)
        for _ in range(5):
            daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)
        wait_until(lambda: daemon.status_info()["tracing"]["failed"] >= 5, timeout=30)
        grown = rss_mib(daemon.proc.pid) - before
        assert grown < 64, f"an endless answer grew the daemon by {grown:.0f} MiB"

        collector.mode = "trickle"
        failed = daemon.status_info()["tracing"]["failed"]
        for _ in range(5):
            daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)
        wait_until(lambda: daemon.status_info()["tracing"]["failed"] >= failed + 5, timeout=30)
        wait_until(lambda: any(mode == "trickle" for mode, _ in collector.exchanges), timeout=10)
        trickled = [took for mode, took in collector.exchanges if mode != "good"]
        assert max(trickled) < 2 + 3, f"an export lasted {max(trickled):.1f}s"

        collector.mode = "good"
        daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)
        wait_until(lambda: collector.good.named("runtime.v1.Version"), timeout=30)
        assert daemon.status_info()["tracing"]["exported"] >= 1
        assert rss_mib(daemon.proc.pid) - before < 64
    finally:
        daemon.stop()
        collector.close()


def test_refused_requests_leave_their_megabytes_out_of_the_queued_spans(short_tmp: Any) -> None:
    """A span describes only a request that passed validation: 1000 ContainerStatus calls
    naming a 250 KiB ID, refused, queued for a collector that never answers, used to keep
    each ID in the queue (the daemon grew by 350 MiB)."""
    with black_hole() as endpoint:
        daemon = Daemon(short_tmp, None, settings={"tracing": {"endpoint": endpoint}})
        daemon.start()
        try:
            assert daemon.proc is not None
            before = rss_mib(daemon.proc.pid)
            request = api_pb2.ContainerStatusRequest(container_id="c" * (250 << 10))
            for _ in range(1000):
                with pytest.raises(grpc.RpcError) as refused:
                    daemon.runtime().ContainerStatus(request, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            figures = daemon.status_info()["tracing"]
            assert figures["ended"] >= 1000 and figures["exported"] == 0
            grown = rss_mib(daemon.proc.pid) - before
            assert grown < 64, f"the queued spans grew the daemon by {grown:.0f} MiB"
        finally:
            daemon.stop()


def test_a_ratio_of_zero_records_nothing_whatever_the_caller_says(short_tmp: Any) -> None:
    """`sampling_ratio = 0`: a caller's sampled traceparent does not make the daemon record
    (it used to record every such call)."""
    with otlp_receiver() as receiver:
        daemon = Daemon(
            short_tmp,
            None,
            settings={"tracing": {"endpoint": receiver.url, "sampling_ratio": 0}},
        )
        daemon.start()
        try:
            for _ in range(100):
                daemon.runtime().Version(
                    api_pb2.VersionRequest(),
                    timeout=10,
                    metadata=(("traceparent", traceparent()[0]),),
                )
            daemon.runtime().Version(api_pb2.VersionRequest(), timeout=10)
            assert daemon.status_info()["tracing"]["ended"] == 0
            assert receiver.spans == []
        finally:
            daemon.stop()


@contextlib.contextmanager
def silent_name_server(short_tmp: Path) -> Iterator[list[str]]:
    """A wrapper that gives the daemon a mount namespace of its own whose resolver asks a
    name server on 127.0.0.153 that takes each query and never answers (30 s a query,
    as a resolver wedged behind a dead server waits)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.153", 53))
    resolv = short_tmp / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.153\noptions timeout:30 attempts:1\n")
    try:
        yield [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(resolv),
        ]  # fmt: skip
    finally:
        server.close()


@pytest.mark.parametrize(
    "collector",
    ["https address, handshake never ends", "https name, never answers", "name never resolved"],
)
def test_a_collector_that_stalls_anywhere_costs_each_export_its_deadline(
    short_tmp: Path, collector: str
) -> None:
    """Whatever step of an export the collector (or the resolver) stalls in, the export
    gives up at `export_timeout` and the next one starts; the RPCs are served all along
    and the daemon stops at once."""
    certificate = self_signed(short_tmp)
    with contextlib.ExitStack() as stack:
        wrapper: list[str] = []
        if collector == "name never resolved":
            wrapper = stack.enter_context(silent_name_server(short_tmp))
            endpoint = "http://collector.stalled.test:4318"
        else:
            address = collector.startswith("https address")
            answer = handshake_never_ends if address else never_answers
            port = stack.enter_context(tls_collector(answer, certificate))
            endpoint = f"https://{'127.0.0.1' if address else 'localhost'}:{port}"
        daemon = Daemon(
            short_tmp,
            None,
            settings={"tracing": {"endpoint": endpoint, "export_timeout": "2s"}},
            env={"SSL_CERT_FILE": str(certificate[0])},
            wrapper=wrapper,
        )
        daemon.start()
        try:
            slowest, calls, started = 0.0, 0, time.monotonic()
            while time.monotonic() - started < 8:
                call = time.monotonic()
                daemon.runtime().Version(api_pb2.VersionRequest(), timeout=5)
                slowest = max(slowest, time.monotonic() - call)
                calls += 1
                time.sleep(0.1)
            failed = daemon.status_info()["tracing"]["failed"]
            print(
                f"{collector}: of {calls} spans in 8 s, {failed} failed to export; "
                f"slowest Version {slowest:.3f} s"
            )
            # Exports end every 2 s at the latest, so most of the spans have had theirs end
            # (about half, from the daemon's first export a second in).
            assert failed >= calls // 4, f"of {calls} spans in 8 s, {failed} had their export end"
        finally:
            assert daemon.stop() == 0
