"""GetContainerEvents: the lifecycle's events as a server stream (kubelet's evented PLEG),
sent as lifecycle/statuses.py rendered them."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.listing import StreamStalled

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView

log = logging.getLogger("cri_shim.server")


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
