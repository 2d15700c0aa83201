"""ReopenContainerLog: conmon reopens a container's log file (after kubelet rotated it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def reopen_container_log(
    view: RuntimeView,
    request: api_pb2.ReopenContainerLogRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ReopenContainerLogResponse:
    await view.containers.reopen_log(request.container_id)
    return api_pb2.ReopenContainerLogResponse()
