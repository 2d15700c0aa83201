"""StartContainer: lifecycle/container_start.py starts a created container."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def start_container(
    view: RuntimeView, request: api_pb2.StartContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StartContainerResponse:
    await view.containers.start(request.container_id)
    return api_pb2.StartContainerResponse()
