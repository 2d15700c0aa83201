"""UpdatePodSandboxResources (in-place pod resize: the pod's total and its overhead):
lifecycle/pod_resources.py checks, records and tells NRI plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def update_pod_sandbox_resources(
    view: RuntimeView,
    request: api_pb2.UpdatePodSandboxResourcesRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdatePodSandboxResourcesResponse:
    await view.pod_resources.update(
        request.pod_sandbox_id,
        request.overhead if request.HasField("overhead") else None,
        request.resources if request.HasField("resources") else None,
    )
    return api_pb2.UpdatePodSandboxResourcesResponse()
