"""StreamContainerStats: ListContainerStats' items, one per message (server/listing.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.list_container_stats import container_stats_listed

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stream_container_stats(
    view: RuntimeView,
    request: api_pb2.StreamContainerStatsRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        container_stats_listed(view, request.filter),
        context,
        lambda stats: api_pb2.StreamContainerStatsResponse(container_stats=[stats]),
    )
