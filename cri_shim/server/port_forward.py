"""PortForward: a single-use streaming URL to a pod's ports, in its network namespace."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def port_forward(
    view: RuntimeView, request: api_pb2.PortForwardRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PortForwardResponse:
    view.pods.netns_of(request.pod_sandbox_id)
    server = await view.streaming.server()
    return api_pb2.PortForwardResponse(url=server.get_portforward_url(request))
