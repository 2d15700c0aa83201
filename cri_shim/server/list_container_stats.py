"""ListContainerStats: the usage of the containers a filter selects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.listing import selected
from cri_shim.server.stats_messages import container_stats_message

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def container_stats_listed(
    view: RuntimeView, f: api_pb2.ContainerStatsFilter
) -> AsyncIterator[api_pb2.ContainerStats]:
    """The stats of the containers `f` selects: ListContainerStats and
    StreamContainerStats."""
    containers = view.containers.list(sandbox_id=f.pod_sandbox_id or None)
    chosen = [c for c in containers if selected(f, c.id, c.config.labels)]
    async for usage in view.usage.containers(chosen):
        yield container_stats_message(view, usage)


async def list_container_stats(
    view: RuntimeView,
    request: api_pb2.ListContainerStatsRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ListContainerStatsResponse:
    stats = await listing.collect(
        container_stats_listed(view, request.filter),
        "ListContainerStats",
        "StreamContainerStats",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListContainerStatsResponse(stats=stats)
