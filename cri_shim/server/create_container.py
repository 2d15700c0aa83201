"""CreateContainer: the container made in its pod by lifecycle/container_create.py, which reserves
its name and keeps the work when the request gives up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.rpc import request_deadline

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def create_container(
    view: RuntimeView, request: api_pb2.CreateContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.CreateContainerResponse:
    container_id = await view.containers.create(
        request.pod_sandbox_id, request.config, request_deadline(context)
    )
    return api_pb2.CreateContainerResponse(container_id=container_id)
