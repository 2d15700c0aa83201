"""StopPodSandbox: lifecycle/sandbox_stop.py stops a pod's containers and tears its network down."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def stop_pod_sandbox(
    view: RuntimeView, request: api_pb2.StopPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StopPodSandboxResponse:
    await view.sandboxes.stop(request.pod_sandbox_id)
    return api_pb2.StopPodSandboxResponse()
