"""OpenTelemetry traces: a span per CRI call, a trace per creation, spans for the work.

Off unless `[tracing] endpoint` is set; while off nothing of OpenTelemetry is imported and
every call here is a no-op on shared objects (`NO_TRACER`, `NO_SPAN`), so the idle daemon's
memory and the hot paths' cost do not change.

The shape of a trace follows the creation contract. A request's server span is a child of
the `traceparent` the caller sent. A creation runs once but may serve several requests (the
one that timed out, duplicates that waited, the retry that claimed the cached object), so
it is a trace of its own: a root span from the reservation until the object is visible or
released, a child span per stage as the journal runs it, and inside those the work (each
CNI plugin, each OCI runtime call). Every request's span links to the creation's root and
carries an event saying what happened to it there ("waited on the creation at stage X",
"handed the finished object", "claimed the cached object"); the root counts the requests it
served. A viewer then shows a pod started on kubelet's third attempt as one creation with
three requests, not three failures.

Spans for the work find their parent in a context variable, so code deep in the host layers
calls `span(...)` without being handed a tracer: outside a traced request or creation it
does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from cri_shim import logcontext


class Span(Protocol):
    """A span being recorded (or the no-op one)."""

    def set_attribute(self, key: str, value: Any) -> None: ...

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None: ...

    def fail(self, message: str) -> None:
        """Mark the span's outcome as an error."""

    def child(self, name: str, attributes: Mapping[str, Any]) -> Span:
        """A span under this one, started now; the caller ends it."""

    def link_to(self, other: Span, attributes: Mapping[str, Any] | None = None) -> None: ...

    def end(self) -> None: ...

    def ids(self) -> tuple[str, str]:
        """(trace ID, span ID) in hex, or empty strings when not recorded."""


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def child(self, name: str, attributes: Mapping[str, Any]) -> Span:
        return self

    def link_to(self, other: Span, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def end(self) -> None:
        pass

    def ids(self) -> tuple[str, str]:
        return "", ""


NO_SPAN: Span = _NoSpan()

# The span that work done now belongs to: a request's server span, or a creation's stage.
_current: contextvars.ContextVar[Span] = contextvars.ContextVar("cri_shim_span", default=NO_SPAN)


def current() -> Span:
    return _current.get()


def _make_current(span: Span) -> contextvars.Token[Span]:
    """From now on (in this task and what it starts) work belongs to `span`, and log lines
    carry its IDs; the token undoes the first."""
    token = _current.set(span)
    trace_id, span_id = span.ids()
    if trace_id:
        logcontext.bind_trace(trace_id, span_id)
    return token


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span]:
    """A span for one piece of work, under the current span; nothing when untraced.

    An exception leaving the block marks the span failed and goes on."""
    parent = _current.get()
    if parent is NO_SPAN:
        yield NO_SPAN
        return
    child = parent.child(name, attributes)
    token = _current.set(child)
    try:
        yield child
    except BaseException as exc:
        child.fail(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        _current.reset(token)
        child.end()


# Requests' events in a creation, as the coordinator counts them: what the request's span is
# told, and whether the request counts as served (it got the object's ID).
_REQUEST_EVENTS: dict[str, tuple[str, bool]] = {
    "reserved": ("started the creation", False),
    "waiting": ("waited on the creation at stage {stage}", False),
    "handed_off": ("handed the finished object", True),
    "claimed": ("claimed the cached object", True),
    "returned_existing": ("returned the existing object", True),
    "name_reserved": ("refused: name is reserved (stage: {stage})", False),
    "timed_out": ("deadline passed; the creation goes on at stage {stage}", False),
    "client_gone": ("client gone; the creation goes on at stage {stage}", False),
}
# Events that mark a new request on the creation (linked once each).
_ARRIVALS = frozenset({"reserved", "waiting", "claimed", "returned_existing", "name_reserved"})


class CreationTrace:
    """One creation's trace: its root span, the span of its current stage, and the requests
    that asked for it. Methods are called by the coordinator from the event loop."""

    def __init__(self, root: Span) -> None:
        self._root = root
        self._stage: Span | None = None
        self._requests = 0
        self._served = 0
        self._ended = False

    def enter(self) -> None:
        """The creation's own task: its work belongs to the creation's root."""
        _make_current(self._root)

    def stage(self, stage: str) -> None:
        """The creation reached `stage`: the previous stage's span ends, this one's starts,
        and the creation's work from now on belongs to it."""
        if self._stage is not None:
            self._stage.end()
        self._stage = self._root.child(stage, {"cri.stage": stage})
        _make_current(self._stage)

    def counted(self, event: str, stage: str) -> None:
        """The coordinator counted `event` for this creation; a request's events go on the
        span of the request doing it (the current one), the rest on the root."""
        request_event = _REQUEST_EVENTS.get(event)
        if event == "created":  # counted by the creation: its requester got the object
            self._served += 1
        if request_event is None:
            self._root.add_event(event, {"cri.stage": stage})
            if event == "failed":
                self._root.fail(f"failed at stage {stage}")
            return
        text, served = request_event
        request = _current.get()
        if event in _ARRIVALS and request is not NO_SPAN:
            self._requests += 1
            request.link_to(self._root, {"cri.creation.event": event})
        request.add_event(text.format(stage=stage), {"cri.stage": stage})
        if served:
            self._served += 1

    def settled(self, *, handed_to: int) -> None:
        """The object was published while `handed_to` duplicates waited: each gets it."""
        self._served += handed_to

    def end(self, outcome: str) -> None:
        """The name's life reached its end for this trace: visible, or released."""
        if self._ended:
            return
        self._ended = True
        if self._stage is not None:
            self._stage.end()
        self._root.set_attribute("cri.creation.outcome", outcome)
        self._root.set_attribute("cri.creation.requests", self._requests)
        self._root.set_attribute("cri.creation.requests_served", self._served)
        self._root.end()


class _NoCreationTrace(CreationTrace):
    def __init__(self) -> None:
        super().__init__(NO_SPAN)

    def enter(self) -> None:
        pass

    def stage(self, stage: str) -> None:
        pass

    def counted(self, event: str, stage: str) -> None:
        pass

    def settled(self, *, handed_to: int) -> None:
        pass

    def end(self, outcome: str) -> None:
        pass


NO_CREATION_TRACE: CreationTrace = _NoCreationTrace()


class Tracer(Protocol):
    """What the edge and the coordinator ask of tracing."""

    def server_span(self, method: str, metadata: Mapping[str, str]) -> Span:
        """A started server span for one CRI call, child of the caller's `traceparent`.
        What the request is about is set once it is validated (server/rpc.py)."""

    def creation(self, kind: str, name: str, object_id: str) -> CreationTrace:
        """A new creation's trace (its root span started), sampled when the current request
        is."""

    def shutdown(self, timeout: float) -> None:
        """Export what is queued, within `timeout` seconds (blocking: call off the loop)."""

    def figures(self) -> dict[str, int]:
        """Spans exported, dropped (queue full) and failed to export, for Status verbose."""


class _NoTracer:
    def server_span(self, method: str, metadata: Mapping[str, str]) -> Span:
        return NO_SPAN

    def creation(self, kind: str, name: str, object_id: str) -> CreationTrace:
        return NO_CREATION_TRACE

    def shutdown(self, timeout: float) -> None:
        pass

    def figures(self) -> dict[str, int]:
        return {}


NO_TRACER: Tracer = _NoTracer()


class _Untraced:
    def __enter__(self) -> Span:
        return NO_SPAN

    def __exit__(self, *exc_info: object) -> None:
        pass


_UNTRACED = _Untraced()


def serving(
    tracer: Tracer, method: str, metadata: Callable[[], Mapping[str, str]]
) -> contextlib.AbstractContextManager[Span]:
    """The server span of one CRI call, current for the call's work and its log lines.

    `metadata` is read only when tracing is on: every call passes here, and an untraced
    one should not pay for it (nor for a generator's context manager)."""
    if tracer is NO_TRACER:
        return _UNTRACED
    return _serving(tracer, method, metadata)


@contextlib.contextmanager
def _serving(
    tracer: Tracer, method: str, metadata: Callable[[], Mapping[str, str]]
) -> Iterator[Span]:
    server = tracer.server_span(method, metadata())
    token = _make_current(server)  # the log binding ends with the caller's log scope
    try:
        yield server
    finally:
        _current.reset(token)
        server.end()
