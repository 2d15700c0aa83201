"""ContainerStats: a container's usage, read live (inspection/usage.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.stats_messages import container_stats_message

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def container_stats(
    view: RuntimeView, request: api_pb2.ContainerStatsRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ContainerStatsResponse:
    usage = await view.usage.container(request.container_id)
    return api_pb2.ContainerStatsResponse(stats=container_stats_message(view, usage))
