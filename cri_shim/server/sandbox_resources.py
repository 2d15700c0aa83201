"""UpdatePodSandboxResources (in-place pod resize: the pod's total and its overhead)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.pod_resources import record_pod_resources

if TYPE_CHECKING:
    from cri_shim.server.components import Components


async def update_pod_sandbox_resources(
    services: Components,
    request: api_pb2.UpdatePodSandboxResourcesRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdatePodSandboxResourcesResponse:
    sandbox = services.sandboxes.get(request.pod_sandbox_id)
    record_pod_resources(
        sandbox,
        request.overhead if request.HasField("overhead") else None,
        request.resources if request.HasField("resources") else None,
    )
    return api_pb2.UpdatePodSandboxResourcesResponse()
