"""A creation's trace as the coordinator drives it, with the real OpenTelemetry SDK and its
in-memory exporter: the claim of a cached object, stage spans, links and counts."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("opentelemetry.sdk", reason="needs opentelemetry-sdk (test extras)")
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cri_shim import tracing
from cri_shim.config import TracingConfig
from cri_shim.creation.coordinator import CreationCoordinator, Stage
from cri_shim.errors import DeadlineExceeded
from cri_shim.tracing.otel import OtelTracer
from tests.unit.creation.creation_fakes import FakeHooks

NAME = "k8s_POD_nginx_default_uid-1_0"


class CachedHooks(FakeHooks):
    def __init__(self) -> None:
        super().__init__()
        self.was_cached = asyncio.Event()

    def cached(self, object_id: str, expires_at: float) -> None:
        super().cached(object_id, expires_at)
        self.was_cached.set()


def exported(tracer: OtelTracer, memory: InMemorySpanExporter) -> list[ReadableSpan]:
    tracer.shutdown(5.0)  # exports what is queued
    return list(memory.get_finished_spans())


async def test_a_claimed_cached_object_is_one_creation_serving_its_retry() -> None:
    memory = InMemorySpanExporter()
    tracer = OtelTracer(TracingConfig(endpoint="http://unused"), exporter=memory)
    hooks = CachedHooks()
    coordinator = CreationCoordinator("sandbox", hooks, tracer=tracer)
    release = asyncio.Event()

    async def creator(object_id: str, stage: Stage) -> None:
        stage.set("sandbox namespaces")
        stage.set("sandbox network")
        with tracing.span("CNI ADD bridge"):
            await release.wait()

    loop = asyncio.get_running_loop()
    with tracing.serving(tracer, "RunPodSandbox", dict) as first:
        with pytest.raises(DeadlineExceeded):
            await coordinator.create(NAME, loop.time() + 0.05, creator)
    release.set()
    await hooks.was_cached.wait()
    with tracing.serving(tracer, "RunPodSandbox", dict) as second:
        object_id = await coordinator.create(NAME, loop.time() + 60, creator)
    await asyncio.sleep(0.05)  # the name's coroutine sees the claim and ends the root
    await coordinator.aclose()

    spans = exported(tracer, memory)
    (root,) = [s for s in spans if s.name == "sandbox creation"]
    assert root.attributes["cri.sandbox_id"] == object_id
    assert root.attributes["cri.creation.outcome"] == "visible"
    assert root.attributes["cri.creation.requests"] == 2
    assert root.attributes["cri.creation.requests_served"] == 1
    assert [e.name for e in root.events] == ["cached"]
    stages = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert [s.name for s in stages] == ["sandbox namespaces", "sandbox network"]
    (cni,) = [s for s in spans if s.name == "CNI ADD bridge"]
    assert cni.parent is not None and cni.parent.span_id == stages[1].context.span_id
    requests = [s for s in spans if s.name == "runtime.v1.RunPodSandbox"]
    assert len(requests) == 2
    for request in requests:
        assert [link.context.span_id for link in request.links] == [root.context.span_id]
        assert request.context.trace_id != root.context.trace_id
    by_id = {s.context.span_id: s for s in requests}
    first_span = by_id[int(first.ids()[1], 16)]
    second_span = by_id[int(second.ids()[1], 16)]
    assert [e.name for e in first_span.events] == [
        "started the creation",
        "deadline passed; the creation goes on at stage sandbox network",
    ]
    assert [e.name for e in second_span.events] == ["claimed the cached object"]


async def test_untraced_work_records_nothing() -> None:
    """Outside a traced call, work spans are the shared no-op one."""
    with tracing.span("CNI ADD bridge") as span:
        assert span is tracing.NO_SPAN
    coordinator = CreationCoordinator("sandbox", FakeHooks())

    async def creator(object_id: str, stage: Stage) -> None:
        stage.set("sandbox network")
        assert tracing.current() is tracing.NO_SPAN

    await coordinator.create(NAME, None, creator)
    await coordinator.aclose()
