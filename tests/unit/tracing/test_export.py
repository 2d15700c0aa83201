"""The span queue's bounds and the sampler's rule, with the real OpenTelemetry SDK."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (test extras)")
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from cri_shim import logcontext, tracing
from cri_shim.config import TracingConfig
from cri_shim.tracing.export import (
    ExportFailed,
    OtlpHttpExporter,
    SpanQueue,
    _target,
    post,
    span_bytes,
)
from cri_shim.tracing.otel import MAX_ATTRIBUTE_LENGTH, OtelTracer
from tests.collectors import (
    TlsAnswer,
    answers,
    handshake_never_ends,
    never_answers,
    reads_and_answers_nothing,
    self_signed,
    serving,
    tls_collector,
    trickles_its_answer,
)


class HeldQueue(SpanQueue):
    DELAY = 3600.0  # exports only when full or shut down


def span(index: int, text: str) -> ReadableSpan:
    context = SpanContext(1, index + 1, is_remote=False, trace_flags=TraceFlags(1))
    return ReadableSpan(name=f"s{index}", context=context, attributes={"big": text})


def test_the_queue_is_bounded_in_bytes_and_keeps_the_newest() -> None:
    memory = InMemorySpanExporter()
    queue = HeldQueue(memory, max_spans=100, max_bytes=64 << 10)
    for index in range(50):
        queue.on_end(span(index, "x" * 4096))
    size = span_bytes(span(0, "x" * 4096))
    assert queue.queued == (64 << 10) // size
    kept = queue.queued
    assert queue.dropped == 50 - kept and queue.ended == 50
    queue.shutdown()
    assert [s.name for s in memory.get_finished_spans()] == [
        f"s{index}" for index in range(50 - kept, 50)
    ]


def test_the_queue_is_bounded_in_spans() -> None:
    queue = HeldQueue(InMemorySpanExporter(), max_spans=10, max_bytes=1 << 30)
    for index in range(25):
        queue.on_end(span(index, ""))
    assert (queue.queued, queue.dropped) == (10, 15)
    queue.shutdown()


def caller(sampled: bool) -> dict[str, str]:
    flags = "01" if sampled else "00"
    return {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-{flags}"}


def recorded(ratio: float, metadata: dict[str, str]) -> bool:
    memory = InMemorySpanExporter()
    tracer = OtelTracer(TracingConfig(endpoint="http://unused", sampling_ratio=ratio), memory)
    with logcontext.scope(), tracing.serving(tracer, "Version", lambda: metadata):
        with tracing.span("work"):
            pass
    tracer.shutdown(5)
    names = [s.name for s in memory.get_finished_spans()]
    assert names in ([], ["work", "runtime.v1.Version"])  # a child follows its parent
    return bool(names)


def test_the_ratio_bounds_what_a_caller_asks_for() -> None:
    assert not recorded(0, caller(sampled=True))
    assert not recorded(0, {})
    assert recorded(1, caller(sampled=True))
    assert recorded(1, {})
    assert not recorded(1, caller(sampled=False))


def test_a_long_attribute_or_status_is_cut() -> None:
    memory = InMemorySpanExporter()
    tracer = OtelTracer(TracingConfig(endpoint="http://unused"), memory)
    with logcontext.scope(), tracing.serving(tracer, "Version", dict) as server:
        server.set_attribute("cri.name", "n" * 100_000)
        server.fail("e" * 100_000)
    tracer.shutdown(5)
    (exported,) = memory.get_finished_spans()
    assert exported.attributes is not None
    assert len(str(exported.attributes["cri.name"])) == MAX_ATTRIBUTE_LENGTH
    assert len(exported.status.description or "") == MAX_ATTRIBUTE_LENGTH


def test_an_unsampled_request_has_its_creation_unrecorded() -> None:
    memory = InMemorySpanExporter()
    tracer = OtelTracer(TracingConfig(endpoint="http://unused"), memory)
    with logcontext.scope(), tracing.serving(tracer, "RunPodSandbox", lambda: caller(False)):
        creation = tracer.creation("sandbox", "pod", "id")
        creation.end("visible")
    tracer.shutdown(5)
    assert list(memory.get_finished_spans()) == []


@contextlib.contextmanager
def collector(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """Plain HTTP on 127.0.0.1, each request read up to its body and answered by `answer`."""

    def serve(connection: socket.socket) -> None:
        received = b""
        while b"\r\n\r\n" not in received:
            received += connection.recv(65536)
        answer(connection)

    with serving(serve) as port:
        yield f"http://127.0.0.1:{port}/v1/traces"


def endless(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    while True:
        connection.sendall(b"\0" * 65536)


def trickle(connection: socket.socket) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
        connection.sendall(bytes([byte]))
        time.sleep(0.1)


def refuse(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")


def accept(connection: socket.socket) -> None:
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n\n\0")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (endless, "longer than 65536 bytes"),
        (trickle, "within 1 s"),
        (refuse, "HTTP 503"),
        (accept, None),
    ],
)
def test_an_export_reads_a_bounded_answer_within_its_deadline(
    answer: Callable[[socket.socket], None], error: str | None
) -> None:
    with collector(answer) as url:
        target = _target(url)
        started = time.monotonic()
        if error is None:
            post(target, b"spans", 1.0, None)
        else:
            with pytest.raises(ExportFailed, match=error):
                post(target, b"spans", 1.0, None)
        assert time.monotonic() - started < 1.5


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def exported_within(
    url: str, body: bytes, timeout: float, tls: ssl.SSLContext | None
) -> tuple[float, BaseException | None]:
    """How long `post` took, and what it raised; it runs on a thread of its own, and a
    post still running after 10 s is reported as such (the test fails, not hangs)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            post(_target(url), body, timeout, tls)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    took = time.monotonic() - started
    assert outcome, f"the export was still running after {took:.1f} s (deadline {timeout} s)"
    return took, outcome[0]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
@pytest.mark.parametrize(
    ("answer", "body_mib", "error"),
    [
        (handshake_never_ends, 0, "within 1 s"),
        (never_answers, 0, "within 1 s"),
        (never_answers, 16, "within 1 s"),  # the send itself outlasts the deadline
        (trickles_its_answer, 0, "within 1 s"),
        (answers, 0, None),
    ],
)
def test_an_https_export_ends_within_its_deadline(
    certificate: tuple[Path, Path], host: str, answer: TlsAnswer, body_mib: int, error: str | None
) -> None:
    trusted = ssl.create_default_context(cafile=certificate[0])
    with tls_collector(answer, certificate) as port:
        url = f"https://{host}:{port}/v1/traces"
        took, raised = exported_within(url, b"s" * (body_mib << 20), 1.0, trusted)
    if error is None:
        assert raised is None
    else:
        assert isinstance(raised, ExportFailed) and error in str(raised), raised
    assert took < 1.5, f"the export took {took:.1f} s"


@pytest.fixture
def without_socket_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every socket blocks for as long as its peer makes it, timeouts asked or not: what
    then ends an export at its deadline is the watchdog alone."""
    monkeypatch.setattr(socket.socket, "settimeout", lambda self, value: None)


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_the_watchdog_alone_ends_an_export_at_its_deadline(
    certificate: tuple[Path, Path], without_socket_timeouts: None, scheme: str
) -> None:
    trusted = ssl.create_default_context(cafile=certificate[0])
    answer = handshake_never_ends if scheme == "https" else reads_and_answers_nothing
    with tls_collector(answer, certificate) as port:
        url = f"{scheme}://127.0.0.1:{port}/v1/traces"
        took, raised = exported_within(url, b"spans", 1.0, trusted if scheme == "https" else None)
    assert isinstance(raised, ExportFailed) and "within 1 s" in str(raised), raised
    assert took < 1.5, f"the export took {took:.1f} s"


class StalledResolver:
    """A fake of the system's resolver: `stalled` names are answered only once the test
    lets them go (as a DNS server that does not answer, or a wedged NSS module); the
    others are looked up by the real one. Counts the lookups of stalled names."""

    def __init__(self, stalled: str) -> None:
        self.stalled = stalled
        self.asked = 0
        self.release = threading.Event()
        self._real = socket.getaddrinfo

    def __call__(self, host: str, *args: object, **kwargs: object) -> object:
        if host == self.stalled:
            self.asked += 1
            self.release.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return self._real(host, *args, **kwargs)  # type: ignore[arg-type]


def test_a_name_whose_resolution_stalls_ends_each_export_within_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = StalledResolver("collector.stalled.test")
    monkeypatch.setattr(socket, "getaddrinfo", fake)
    url = "http://collector.stalled.test:4318/v1/traces"
    try:
        took, raised = exported_within(url, b"spans", 1.0, None)
        assert isinstance(raised, ExportFailed) and "not resolved" in str(raised), raised
        assert took < 1.5, f"the export took {took:.1f} s"
        exporter = OtlpHttpExporter(url, timeout=1.0)
        for index in range(3):
            started = time.monotonic()
            exporting = threading.Thread(target=exporter.export, args=([span(index, "")],))
            exporting.start()
            exporting.join(10)
            took = time.monotonic() - started
            assert not exporting.is_alive(), f"an export was still running after {took:.1f} s"
            assert took < 1.5, f"the export took {took:.1f} s"
        # The exports that came while it stalled waited for the one lookup under way.
        assert fake.asked == 2  # the post's own, and the exporter's
    finally:
        fake.release.set()
