"""The span queue's bounds and the sampler's rule, with the real OpenTelemetry SDK."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (test extras)")
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from cri_shim import logcontext, tracing
from cri_shim.config import TracingConfig
from cri_shim.tracing.export import ExportFailed, SpanQueue, _target, post, span_bytes
from cri_shim.tracing.otel import MAX_ATTRIBUTE_LENGTH, OtelTracer


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
    """One connection at a time on 127.0.0.1, read up to its body, answered by `answer`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                with connection, contextlib.suppress(OSError):
                    received = b""
                    while b"\r\n\r\n" not in received:
                        received += connection.recv(65536)
                    answer(connection)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"
    finally:
        listener.close()


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
