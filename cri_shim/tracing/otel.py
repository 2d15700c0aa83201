"""Tracing with the OpenTelemetry SDK, exported over OTLP/HTTP (protobuf).

Imported only when `[tracing] endpoint` is set. Ended spans wait in a queue whose thread
exports them (cri_shim/tracing/export.py): nothing waits for the collector on the event
loop, the queue is bounded in spans and in bytes (`max_queued_spans`, `max_queued_bytes`;
beyond either the oldest are dropped), and each export gives up after `export_timeout`, so
a dead or hostile collector costs a full queue and a counter, never growing memory or a
blocked RPC.

Sampling: `sampling_ratio` is the share of traces recorded, whoever started them. A trace
is recorded when its ID falls within the ratio (OpenTelemetry's TraceIdRatioBased rule, so
a caller sampling with that rule at a lower ratio has each of its sampled traces recorded
here too) and the caller's `traceparent`, if any, does not say "not sampled". A caller
cannot make the daemon record more than the operator's ratio: 0 records nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    Decision,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cri_shim import __version__
from cri_shim.config import TracingConfig
from cri_shim.tracing import CreationTrace, Span, current
from cri_shim.tracing.export import OtlpHttpExporter, SpanQueue

# A new root span with this attribute follows the sampling decision it carries instead of
# the ratio: a creation is recorded exactly when the request that started it is.
_FOLLOW = "cri_shim.sampled"
# Longest string attribute or status message kept (longer ones are cut): IDs and names
# are far shorter, and a span is no place for a request's megabytes.
MAX_ATTRIBUTE_LENGTH = 1024


class _Sampler(Sampler):
    """See the module docstring: the ratio bounds every trace, a caller's "not sampled" is
    followed, and spans inside a trace follow their parent's decision."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Any = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        follow = (attributes or {}).get(_FOLLOW)
        if parent.is_valid and not parent.is_remote:
            follow = parent.trace_flags.sampled  # decided where its trace began
        elif parent.is_valid and not parent.trace_flags.sampled:
            follow = False
        if follow is not None:
            decision = Decision.RECORD_AND_SAMPLE if follow else Decision.DROP
            return SamplingResult(decision, attributes)
        return self._ratio.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"cri-shim sampler ({self._ratio.get_description()})"


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and what it failed to."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.exported = 0
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        with self._lock:
            if result is SpanExportResult.SUCCESS:
                self.exported += len(spans)
            else:
                self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _OtelSpan:
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.span.add_event(name, dict(attributes or {}))

    def fail(self, message: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, message[:MAX_ATTRIBUTE_LENGTH]))

    def child(self, name: str, attributes: Mapping[str, Any]) -> Span:
        context = trace.set_span_in_context(self.span)
        return _OtelSpan(
            self._tracer,
            self._tracer.start_span(name, context=context, attributes=dict(attributes)),
        )

    def link_to(self, other: Span, attributes: Mapping[str, Any] | None = None) -> None:
        if isinstance(other, _OtelSpan):
            self.span.add_link(other.span.get_span_context(), dict(attributes or {}))

    def end(self) -> None:
        self.span.end()

    def ids(self) -> tuple[str, str]:
        context = self.span.get_span_context()
        if not context.is_valid:
            return "", ""
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"


class OtelTracer:
    """The daemon's tracer: one provider, one bounded queue, one OTLP exporter."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """`exporter` replaces the OTLP one (tests hand in the SDK's in-memory exporter)."""
        self._exporter = _CountingExporter(
            exporter
            if exporter is not None
            else OtlpHttpExporter(
                config.endpoint.rstrip("/") + "/v1/traces", timeout=config.export_timeout
            )
        )
        self._provider = TracerProvider(
            resource=Resource.create(
                {"service.name": config.service_name, "service.version": __version__}
            ),
            sampler=_Sampler(config.sampling_ratio),
            span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_LENGTH),
            # The daemon's stop flushes the queue within a bounded wait (shutdown below);
            # the SDK's exit hook would wait for a stuck export without bound.
            shutdown_on_exit=False,
        )
        self._queue = SpanQueue(
            self._exporter, max_spans=config.max_queued_spans, max_bytes=config.max_queued_bytes
        )
        self._provider.add_span_processor(self._queue)
        self._tracer = self._provider.get_tracer("cri_shim", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def server_span(self, method: str, metadata: Mapping[str, str]) -> Span:
        parent = self._propagator.extract(carrier=dict(metadata))
        span = self._tracer.start_span(
            f"runtime.v1.{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method},
        )
        return _OtelSpan(self._tracer, span)

    def creation(self, kind: str, name: str, object_id: str) -> CreationTrace:
        attributes: dict[str, Any] = {
            "cri.kind": kind,
            "cri.name": name,
            f"cri.{kind}_id": object_id,
        }
        request = current()
        if isinstance(request, _OtelSpan):
            attributes[_FOLLOW] = request.span.get_span_context().trace_flags.sampled
        # Else no request started it: the ratio decides.
        root = self._tracer.start_span(
            f"{kind} creation",
            context=Context(),  # a trace of its own: it may serve many requests
            attributes=attributes,
        )
        return CreationTrace(_OtelSpan(self._tracer, root))

    def shutdown(self, timeout: float) -> None:
        # The queue's shutdown exports what is queued, each export within export_timeout:
        # it runs in a daemon thread of its own, waited for `timeout`, so that neither the
        # stop nor the process exit waits longer.
        closing = threading.Thread(
            target=self._queue.shutdown, name="trace export shutdown", daemon=True
        )
        closing.start()
        closing.join(timeout)

    def figures(self) -> dict[str, int]:
        """Spans sampled and ended, exported, failed to export, waiting in the queue, and
        dropped because the queue was full."""
        return {
            "ended": self._queue.ended,
            "exported": self._exporter.exported,
            "failed": self._exporter.failed,
            "queued": self._queue.queued,
            "dropped": self._queue.dropped,
        }
