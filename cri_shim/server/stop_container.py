"""StopContainer: lifecycle/container_stop.py stops a container within its grace period."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stop_container(
    view: RuntimeView, request: api_pb2.StopContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StopContainerResponse:
    await view.containers.stop(request.container_id, float(request.timeout))
    return api_pb2.StopContainerResponse()
