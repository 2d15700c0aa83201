"""Exec, Attach and PortForward: validate, then hand out a single-use streaming URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.components import Components


async def exec_(
    services: Components, request: api_pb2.ExecRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ExecResponse:
    services.containers.get_running(request.container_id)
    return api_pb2.ExecResponse(url=(await services.streaming.server()).get_exec_url(request))


async def attach(
    services: Components, request: api_pb2.AttachRequest, context: grpc.aio.ServicerContext
) -> api_pb2.AttachResponse:
    services.containers.get_running(request.container_id)
    return api_pb2.AttachResponse(url=(await services.streaming.server()).get_attach_url(request))


async def port_forward(
    services: Components, request: api_pb2.PortForwardRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PortForwardResponse:
    services.sandboxes.pods.netns_of(request.pod_sandbox_id)
    server = await services.streaming.server()
    return api_pb2.PortForwardResponse(url=server.get_portforward_url(request))
