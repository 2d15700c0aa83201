"""RemoveContainer: lifecycle/container_remove.py removes a container, stopping it first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def remove_container(
    view: RuntimeView, request: api_pb2.RemoveContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RemoveContainerResponse:
    await view.containers.remove(request.container_id)
    return api_pb2.RemoveContainerResponse()
