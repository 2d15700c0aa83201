"""Tracing with the OpenTelemetry SDK, exported over OTLP/HTTP (protobuf).

Imported only when `[tracing] endpoint` is set. Spans are queued by the SDK's batch
processor, whose thread exports them: nothing waits for the collector on the event loop, the
queue is bounded (`max_queued_spans`; beyond it the oldest are dropped), and each export
gives up after `export_timeout`, so a dead collector costs a full queue and a counter, never
growing memory or a blocked RPC.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cri_shim import __version__
from cri_shim.config import TracingConfig
from cri_shim.tracing import NO_SPAN, CreationTrace, Span, current

# A new root span with this attribute follows the sampling decision it carries instead of
# the ratio: a creation is recorded exactly when the request that started it is.
_FOLLOW = "cri_shim.sampled"


class _RootSampler(Sampler):
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
        follow = (attributes or {}).get(_FOLLOW)
        if follow is not None:
            decision = Decision.RECORD_AND_SAMPLE if follow else Decision.DROP
            return SamplingResult(decision, attributes)
        return self._ratio.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"cri-shim root sampler ({self._ratio.get_description()})"


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and what it failed to."""

    def __init__(self, inner: SpanExporter) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.exported = 0
        self.failed = 0
        self.in_flight = 0  # in the export under way

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            self.in_flight = len(spans)
        try:
            result = self._inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        with self._lock:
            self.in_flight = 0
            if result is SpanExportResult.SUCCESS:
                self.exported += len(spans)
            else:
                self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _EndCounter(SpanProcessor):
    """Counts the sampled spans that ended (the batch processor's input)."""

    def __init__(self) -> None:
        self.count = 0

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self.count += 1


class _OtelSpan:
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self.span.add_event(name, dict(attributes or {}))

    def fail(self, message: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, message))

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
    """The daemon's tracer: one provider, one batch processor, one OTLP exporter."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """`exporter` replaces the OTLP one (tests hand in the SDK's in-memory exporter)."""
        self._exporter = _CountingExporter(
            exporter
            if exporter is not None
            else OTLPSpanExporter(
                endpoint=config.endpoint.rstrip("/") + "/v1/traces",
                timeout=config.export_timeout,
            )
        )
        self._provider = TracerProvider(
            resource=Resource.create(
                {"service.name": config.service_name, "service.version": __version__}
            ),
            sampler=ParentBased(root=_RootSampler(config.sampling_ratio)),
        )
        self._batches = BatchSpanProcessor(
            self._exporter,
            max_queue_size=config.max_queued_spans,
            max_export_batch_size=min(512, config.max_queued_spans),
            schedule_delay_millis=1000,
        )
        self._ended = _EndCounter()
        self._provider.add_span_processor(self._ended)
        self._provider.add_span_processor(self._batches)
        self._tracer = self._provider.get_tracer("cri_shim", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def server_span(
        self, method: str, metadata: Mapping[str, str], attributes: Mapping[str, Any]
    ) -> Span:
        parent = self._propagator.extract(carrier=dict(metadata))
        span = self._tracer.start_span(
            f"runtime.v1.{method}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method, **attributes},
        )
        return _OtelSpan(self._tracer, span)

    def creation(self, kind: str, name: str, object_id: str) -> CreationTrace:
        request = current()
        sampled = request is NO_SPAN or (
            isinstance(request, _OtelSpan) and request.span.get_span_context().trace_flags.sampled
        )
        root = self._tracer.start_span(
            f"{kind} creation",
            context=Context(),  # a trace of its own: it may serve many requests
            attributes={
                _FOLLOW: sampled,
                "cri.kind": kind,
                "cri.name": name,
                f"cri.{kind}_id": object_id,
            },
        )
        return CreationTrace(_OtelSpan(self._tracer, root))

    def shutdown(self, timeout: float) -> None:
        # The processor's shutdown exports what is queued, but waits up to 30 s for an
        # export stuck on a dead collector: it runs in a daemon thread of its own, waited
        # for `timeout`, so that neither the stop nor the process exit waits longer.
        closing = threading.Thread(
            target=self._batches.shutdown, name="trace export shutdown", daemon=True
        )
        closing.start()
        closing.join(timeout)

    def figures(self) -> dict[str, int]:
        """Spans sampled and ended, exported, failed to export, waiting in the queue, and
        dropped because the queue was full (what is left of the ended ones)."""
        # The SDK keeps no count of what its full queue dropped: the queue's length is read
        # from the processor (private, so a missing attribute reads as empty).
        queue = getattr(getattr(self._batches, "_batch_processor", None), "_queue", ())
        queued = len(queue)
        ended, exported, failed = self._ended.count, self._exporter.exported, self._exporter.failed
        return {
            "ended": ended,
            "exported": exported,
            "failed": failed,
            "queued": queued,
            "dropped": max(0, ended - exported - failed - queued - self._exporter.in_flight),
        }
