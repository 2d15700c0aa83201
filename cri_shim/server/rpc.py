"""The gRPC edge's shared plumbing: readiness, deadlines and domain errors to status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from cri_shim import errors, logcontext, tracing
from cri_shim.server.limits import LIST_STREAM_RPCS, STREAM_RPCS, admitted
from cri_shim.server.listing import StreamStalled
from cri_shim.server.wire import LargeRequest

if TYPE_CHECKING:
    from cri_shim.server.views import EdgeView, ObjectNames

log = logging.getLogger("cri_shim.server")

# Answer a little before the client's own deadline so that our DEADLINE_EXCEEDED (with its
# explanation) reaches it rather than its local timeout firing first.
DEADLINE_MARGIN = 0.05

_CODES: list[tuple[type[errors.CriError], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Internal, grpc.StatusCode.INTERNAL),
]


def status_code(error: errors.CriError) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.UNKNOWN


def request_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The client's deadline on the event loop's clock, or None when it set none."""
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return None
    return asyncio.get_running_loop().time() + max(0.0, remaining - DEADLINE_MARGIN)


Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]

# The request fields that name an object, and the kind of object each names.
_OBJECT_FIELDS = (("pod_sandbox_id", "sandbox"), ("container_id", "container"))


def bind_request_objects(names: ObjectNames, request: Any) -> None:
    """Bind the objects the request names by ID to the log context, with their names
    (and full IDs, for an ID prefix) when the daemon knows them."""
    for field, kind in _OBJECT_FIELDS:
        ref = getattr(request, field, "")
        if not isinstance(ref, str) or not ref:
            continue
        object_id, name = names.identify(kind, ref) or (ref, "")
        logcontext.bind_object(kind, object_id, name)


def cri_method_name(name: str) -> str:
    """`run_pod_sandbox` → `RunPodSandbox`: the method as the CRI (and crictl) names it,
    which logs and metrics use, whatever the Python handler is called."""
    if "_" not in name and not name.islower():
        return name
    # A trailing underscore dodges a keyword or builtin (`exec_`); it is not in the name.
    return "".join(part[:1].upper() + part[1:] for part in name.rstrip("_").split("_"))


_NOT_SERVED = contextlib.nullcontext()


def rpc(handler: Handler) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    """Wrap a handler(view, request, context) as the servicer method of the same CRI
    name: `view` is the servicer's (server/views.py)."""
    name = cri_method_name(handler.__name__)
    long_lived = name in STREAM_RPCS
    streams = long_lived or name in LIST_STREAM_RPCS

    @functools.wraps(handler)
    async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        view: EdgeView | None = self.view
        if view is None:
            # Restore has not finished: a partial view would make kubelet recreate pods.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is not initialized yet")
            raise AssertionError("abort returns by raising")
        monitor = view.loop_monitor
        if monitor is not None:
            monitor.note_call()  # the lag is sampled while calls arrive
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        response = None
        with (
            # ... and more often while one is served (not the event stream, which lasts
            # as long as its client).
            monitor.serving() if monitor is not None and not long_lived else _NOT_SERVED,
            logcontext.scope(),  # what the request binds ends with it
            tracing.serving(view.tracer, name, lambda: _metadata(context)) as span,
        ):
            try:
                large = isinstance(request, LargeRequest)
                if large:
                    request = await _parse_off_loop(name, request)
                bind_request_objects(view.names, request)
                # Validated and admitted first: a bad or surplus call does nothing, not even
                # reserve a name or hold a slot that a good call needs.
                response = await admitted(
                    handler, name, view, request, context, request_deadline(context), large
                )
                if streams:
                    return None  # its handler wrote its messages
                # Counted until gRPC lets the call go, serialized: the message goes now.
                return view.limiter.hold_reply(name, response, context)
            except errors.CriError as exc:
                code = status_code(exc)
                log.info("%s: %s: %s", name, code.name, exc)
                # The status waits for a client that reads nothing as long as a reply
                # would: a reply refused for the memory replies hold is not kept for it.
                response = None
                await context.abort(code, str(exc))
            except asyncio.CancelledError as exc:
                # The client went away, or a stream's client stopped reading (logged).
                stalled = isinstance(exc, StreamStalled)
                code = grpc.StatusCode.DEADLINE_EXCEEDED if stalled else grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                code = grpc.StatusCode.INTERNAL
                log.exception("%s failed unexpectedly", name)
                await context.abort(code, f"{name} failed: {type(exc).__name__}: {exc}")
            finally:
                if span is not tracing.NO_SPAN:
                    _describe(span, code, request, response)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if code is not grpc.StatusCode.OK:
                        span.fail(code.name)
                if view.rpc_metrics is not None:
                    view.rpc_metrics.observe_rpc(name, code.name, time.perf_counter() - started)

    method.__name__ = name
    return method


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """The call's metadata as text (where a caller's `traceparent` is)."""
    return {
        key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)
    }


def _describe(span: tracing.Span, code: grpc.StatusCode, request: Any, response: Any) -> None:
    """What a call's span says it was about, once it is over. Only a request that passed
    validation is described: a refused one may carry anything (a 250 KiB ID), and its
    span would keep it until exported."""
    if code is grpc.StatusCode.INVALID_ARGUMENT or isinstance(request, LargeRequest):
        return
    for key, value in _span_attributes(request).items():
        span.set_attribute(key, value)
    _note_response(span, response)


def _span_attributes(request: Any) -> dict[str, str]:
    """What a call's span says it is about: the IDs and names the request carries."""
    attributes: dict[str, str] = {}
    for field, kind in _OBJECT_FIELDS:
        value = getattr(request, field, "")
        if isinstance(value, str) and value:
            attributes[f"cri.{kind}_id"] = value
    config = getattr(request, "config", None)
    metadata: Any = getattr(config, "metadata", None)
    name = getattr(metadata, "name", None)
    if isinstance(name, str) and name:
        kind = "sandbox" if hasattr(metadata, "namespace") else "container"
        attributes[f"cri.{kind}_name"] = name
        if kind == "sandbox":
            attributes["k8s.namespace.name"] = metadata.namespace
            attributes["k8s.pod.uid"] = metadata.uid
    return attributes


def _note_response(span: tracing.Span, response: Any) -> None:
    """The ID a creation answered with (RunPodSandbox, CreateContainer)."""
    if span is tracing.NO_SPAN:
        return
    for field, kind in _OBJECT_FIELDS:
        value = getattr(response, field, "")
        if isinstance(value, str) and value:
            span.set_attribute(f"cri.{kind}_id", value)


async def _parse_off_loop(name: str, request: LargeRequest) -> Any:
    try:
        return await asyncio.to_thread(request.parse)
    except DecodeError as exc:
        raise errors.InvalidArgument(
            f"{name}: the request is not a valid {request.message_class.__name__}: {exc}"
        ) from None


def unimplemented(
    name: str, issue: str
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def method(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by cri-shim yet ({issue})"
        )

    method.__name__ = name
    return method
