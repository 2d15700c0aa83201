"""Spans on their way to the collector: a queue bounded in spans and in bytes, and an
OTLP/HTTP exporter that bounds what it waits for and what it reads.

Imported only when tracing is on (with the SDK, cri_shim/tracing/otel.py). Whatever answers
at `[tracing] endpoint` is not trusted: the SDK's exporter read the whole answer body (an
endless one grew the daemon by what it sent) and gave each read its own timeout (a collector
trickling a byte every 2 s kept every export pending for ever). Here one deadline,
`export_timeout`, covers the whole exchange (the name's resolution, connect, the TLS
handshake, send, the answer), over http and https alike, and at most `MAX_ANSWER_BYTES`
of the answer are read before the connection is dropped.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from cri_shim import __version__

log = logging.getLogger("cri_shim.tracing")

# A collector answers an export with an empty or tiny message (a partial-success count).
MAX_ANSWER_BYTES = 64 << 10
# Failed exports are logged at most this often (a dead collector fails every second).
FAILURE_LOG_INTERVAL = 60.0


class ExportFailed(Exception):
    """The collector did not take the spans; the message says why."""


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    tls: bool
    path: str  # with its query
    authority: str  # the Host header


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]
    return _Target(host, port, tls, path, authority)


class OtlpHttpExporter(SpanExporter):
    """POSTs each batch as an `ExportTraceServiceRequest` (protobuf) to `url`, on a
    connection of its own, within `timeout` seconds in all; a 2xx status is success."""

    def __init__(self, url: str, timeout: float) -> None:
        self._url = url
        self._target = _target(url)
        self._timeout = timeout
        self._tls = ssl.create_default_context() if self._target.tls else None
        self._resolver = Resolver()
        self._last_failure_log = -FAILURE_LOG_INTERVAL
        self._unlogged_failures = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        body = encode_spans(spans).SerializeToString()
        try:
            post(self._target, body, self._timeout, self._tls, self._resolver)
        except (OSError, ExportFailed) as exc:
            self._note_failure(len(spans), exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _note_failure(self, spans: int, exc: Exception) -> None:
        self._unlogged_failures += 1
        now = time.monotonic()
        if now - self._last_failure_log < FAILURE_LOG_INTERVAL:
            return
        log.warning(
            "exporting %d spans to %s failed: %s (%d failed exports since the last such line; "
            "counted in Status verbose as tracing.failed)",
            spans,
            self._url,
            exc,
            self._unlogged_failures,
        )
        self._last_failure_log = now
        self._unlogged_failures = 0

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def post(
    target: _Target,
    body: bytes,
    timeout: float,
    tls: ssl.SSLContext | None,
    resolver: Resolver | None = None,
) -> None:
    """One POST of `body`, answered 2xx within `timeout` seconds, or ExportFailed/OSError.

    Each blocking step gets what is left of the deadline; a step that blocks past it
    (a send over TLS waits anew for each record the collector takes) is cut by a
    watchdog that shuts the connection down at the deadline, the TLS layer's included."""
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ExportFailed(
                f"no complete answer within {timeout:g} s ([tracing] export_timeout)"
            )
        return remaining

    addresses = (resolver or Resolver()).resolve(target.host, target.port, left)
    sock = _connect(addresses, left)
    watchdog = _Watchdog(sock, left())
    try:
        if tls is not None:
            wrapped = watchdog.take_over(
                lambda: tls.wrap_socket(
                    sock, server_hostname=target.host, do_handshake_on_connect=False
                )
            )
            sock = wrapped
            wrapped.settimeout(left())
            wrapped.do_handshake()
        head = (
            f"POST {target.path} HTTP/1.1\r\n"
            f"Host: {target.authority}\r\n"
            f"User-Agent: cri-shim/{__version__}\r\n"
            "Content-Type: application/x-protobuf\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode("ascii")
        sock.settimeout(left())
        sock.sendall(head + body)
        status = _read_status(sock, left)
    except OSError:
        left()  # a step cut at the deadline says so
        raise
    finally:
        watchdog.cancel()
        sock.close()  # whatever the collector still sends is not read
    if not 200 <= status < 300:
        raise ExportFailed(f"the collector answered HTTP {status}")


Addresses = Sequence[tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]]


class Resolver:
    """The collector's addresses, looked up within the export's deadline.

    getaddrinfo cannot be given a deadline: the system's resolver waits 5 s per server and
    attempt by default, an NSS module as long as it likes. So a name is looked up on a
    thread of its own that the export waits for only until its deadline. One lookup at a
    time: an export that finds the last one still running waits for that one rather than
    starting another, so a resolver that never answers costs one thread, not one per
    export. An address (the default endpoint's 127.0.0.1 say) is not looked up at all."""

    def __init__(self) -> None:
        self._lookup: _Lookup | None = None

    def resolve(self, host: str, port: int, left: Callable[[], float]) -> Addresses:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:  # numeric: answered at once, without the resolver
            return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=_NUMERIC)
        if self._lookup is None or self._lookup.done.is_set():
            self._lookup = _Lookup(host, port)
        lookup = self._lookup
        if not lookup.done.wait(left()):
            raise ExportFailed(f"{host} was not resolved in time ([tracing] export_timeout)")
        if lookup.error is not None:
            raise lookup.error
        return lookup.addresses


_NUMERIC = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV


class _Lookup:
    """One getaddrinfo on a daemon thread (one stuck in the resolver must not hold up the
    daemon's exit)."""

    def __init__(self, host: str, port: int) -> None:
        self.done = threading.Event()
        self.addresses: Addresses = []
        self.error: OSError | None = None
        thread = threading.Thread(
            target=self._run, args=(host, port), name="trace export resolve", daemon=True
        )
        thread.start()

    def _run(self, host: str, port: int) -> None:
        try:
            self.addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            self.error = exc
        finally:
            self.done.set()


def _connect(addresses: Addresses, left: Callable[[], float]) -> socket.socket:
    """A connection to the first of `addresses` that takes one, within the deadline."""
    error: OSError = OSError("the name has no address")
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left())
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
        else:
            return sock
    raise error


Wrapped = TypeVar("Wrapped", bound=socket.socket)


class _Watchdog:
    """Shuts the export's connection down once `after` seconds have passed, whichever
    object holds it by then: the TLS layer takes the socket over (the one it was given is
    detached, and shutting that down would do nothing)."""

    def __init__(self, sock: socket.socket, after: float) -> None:
        self._lock = threading.Lock()
        self._sock = sock
        self._fired = False
        self._timer = threading.Timer(after, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def take_over(self, wrap: Callable[[], Wrapped]) -> Wrapped:
        """The socket `wrap` makes of the one watched (without I/O), watched instead."""
        with self._lock:
            wrapped = wrap()
            self._sock = wrapped
            fired = self._fired
        if fired:
            _cut(wrapped)
        return wrapped

    def _fire(self) -> None:
        with self._lock:
            self._fired = True
            sock = self._sock
        _cut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _read_status(sock: socket.socket, left: Callable[[], float]) -> int:
    """The status of the answer, once it is complete: its body as long as its
    Content-Length says, or up to the end of the connection (we asked for its close).
    An answer over MAX_ANSWER_BYTES is not read further: no collector sends one."""
    answer = b""
    while True:
        head, separator, body = answer.partition(b"\r\n\r\n")
        if separator:
            length = _content_length(head)
            if length is not None and len(body) >= length:
                break
        if len(answer) >= MAX_ANSWER_BYTES:
            raise ExportFailed(f"the answer is longer than {MAX_ANSWER_BYTES} bytes")
        sock.settimeout(left())
        chunk = sock.recv(MAX_ANSWER_BYTES + 1 - len(answer))
        if not chunk:
            left()  # cut at the deadline (_cut) rather than hung up: say so
            if not separator:
                raise ExportFailed(f"the collector hung up after {len(answer)} bytes of its answer")
            break
        answer += chunk
    line = head.partition(b"\r\n")[0].split(None, 2)
    if len(line) < 2 or not line[0].startswith(b"HTTP/") or not line[1].isdigit():
        raise ExportFailed("the answer is not HTTP")
    return int(line[1])


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


def _cut(sock: socket.socket) -> None:
    # shutdown, not close: the descriptor stays the exporter's, so it cannot be reused
    # under it; its blocked call returns at once.
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def span_bytes(span: ReadableSpan) -> int:
    """What a queued span costs, roughly: its strings and values, and a fixed part for the
    objects that hold them. Cheap enough for every span ended on the event loop."""
    size = 512 + len(span.name) + _attributes_bytes(span.attributes)
    for event in span.events:
        size += 64 + len(event.name) + _attributes_bytes(event.attributes)
    for link in span.links:
        size += 64 + _attributes_bytes(link.attributes)
    description = span.status.description
    return size + (len(description) if description else 0)


def _attributes_bytes(attributes: Any) -> int:
    if not attributes:
        return 0
    return sum(64 + len(key) + _value_bytes(value) for key, value in attributes.items())


def _value_bytes(value: object) -> int:
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, tuple | list):
        return sum(8 + _value_bytes(item) for item in value)
    return 8


class SpanQueue(SpanProcessor):
    """The ended, sampled spans waiting for export, at most `max_spans` of them and
    `max_bytes` (span_bytes) in all: beyond either the oldest are dropped and counted.
    A thread of its own exports them in batches, once a second or when a batch is full,
    so that nothing waits for the collector on the event loop."""

    BATCH = 512
    DELAY = 1.0

    def __init__(self, exporter: SpanExporter, max_spans: int, max_bytes: int) -> None:
        self._exporter = exporter
        self._max_spans = max_spans
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._spans: deque[tuple[ReadableSpan, int]] = deque()
        self._bytes = 0
        self.ended = 0
        self.dropped = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trace export", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._spans)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        size = span_bytes(span)
        with self._lock:
            self.ended += 1
            self._spans.append((span, size))
            self._bytes += size
            while len(self._spans) > self._max_spans or self._bytes > self._max_bytes:
                _, dropped = self._spans.popleft()
                self._bytes -= dropped
                self.dropped += 1
            full = len(self._spans) >= self.BATCH
        if full:
            self._wake.set()

    def _take(self) -> list[ReadableSpan]:
        with self._lock:
            batch: list[ReadableSpan] = []
            while self._spans and len(batch) < self.BATCH:
                span, size = self._spans.popleft()
                self._bytes -= size
                batch.append(span)
            return batch

    def _run(self) -> None:
        while True:
            self._wake.wait(self.DELAY)
            self._wake.clear()
            stopping = self._stopping.is_set()
            while batch := self._take():
                try:
                    self._exporter.export(batch)
                except Exception:  # the thread must outlive one bad batch
                    log.exception("exporting %d spans failed", len(batch))
                if not stopping and len(self._spans) < self.BATCH:
                    break  # the rest waits for the next round
            if stopping:
                return

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocks as long as that takes)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
