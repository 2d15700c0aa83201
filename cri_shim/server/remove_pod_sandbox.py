"""RemovePodSandbox: lifecycle/sandbox_remove.py removes a pod and everything in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def remove_pod_sandbox(
    view: RuntimeView,
    request: api_pb2.RemovePodSandboxRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.RemovePodSandboxResponse:
    await view.sandboxes.remove(request.pod_sandbox_id)
    return api_pb2.RemovePodSandboxResponse()
