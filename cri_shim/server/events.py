"""GetContainerEvents: the lifecycle's events as a server stream (kubelet's evented PLEG)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError
from cri_shim.lifecycle.events import ContainerEvent
from cri_shim.server.container import to_status
from cri_shim.server.listing import StreamStalled
from cri_shim.server.sandbox import to_pod_sandbox_status
from cri_shim.state.records import ContainerRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView

log = logging.getLogger("cri_shim.server")


class EventRenderer:
    """The CRI message of an event, made when the event happens: `sandbox_of` finds a
    visible pod, `containers_of` a pod's visible containers as recorded."""

    def __init__(
        self,
        sandbox_of: Callable[[str], SandboxRecord],
        containers_of: Callable[[str], list[ContainerRecord]],
    ) -> None:
        self._sandbox_of = sandbox_of
        self._containers_of = containers_of

    def __call__(self, event: ContainerEvent) -> bytes | None:
        """The serialized ContainerEventResponse, with the pod's status and its
        containers' statuses as they are at the moment of the transition: serialized
        once, and the same bytes go to every subscriber (services.py sends bytes as they
        are). None drops the event: kubelet ignores an event without a pod sandbox
        status, so there is no point in sending one."""
        try:
            sandbox = self._sandbox_of(event.sandbox_id)
        except CriError:
            log.debug("event %s of %s: its pod is gone", event.kind_name, event.container_id)
            return None
        return api_pb2.ContainerEventResponse(
            container_id=event.container_id,
            container_event_type=api_pb2.ContainerEventType.ValueType(event.kind),
            created_at=event.created_at,
            pod_sandbox_status=to_pod_sandbox_status(sandbox),
            containers_statuses=[to_status(c) for c in self._containers_of(sandbox.id)],
        ).SerializeToString()


async def get_container_events(
    view: RuntimeView, request: api_pb2.GetEventsRequest, context: grpc.aio.ServicerContext
) -> None:
    """Stream events until the client goes away (or the daemon stops). A subscriber that
    falls behind by more than `[events] max_backlog_bytes` is dropped (lifecycle/events.py):
    its stream ends with RESOURCE_EXHAUSTED once it reads what was sent, or is cancelled at
    once when a write of ours still waits for it to read (gRPC sends no status behind an
    unread message). It never slows the daemon down."""
    with view.events.subscribe() as subscription:
        log.info("container events: subscriber %d connected", subscription.number)
        try:
            async for response in subscription:
                try:
                    async with asyncio.timeout(None) as sending:
                        subscription.on_fell_behind = lambda: sending.reschedule(-1)
                        await context.write(response)
                except TimeoutError:
                    raise StreamStalled from None  # dropped while we waited: see above
                finally:
                    subscription.on_fell_behind = None
        finally:
            log.info("container events: subscriber %d disconnected", subscription.number)
