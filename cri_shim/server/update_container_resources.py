"""UpdateContainerResources: a container's limits changed in place
(lifecycle/container_update.py, with NRI's say)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def update_container_resources(
    view: RuntimeView,
    request: api_pb2.UpdateContainerResourcesRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdateContainerResourcesResponse:
    await view.containers.update_resources(request.container_id, request.linux)
    return api_pb2.UpdateContainerResourcesResponse()
