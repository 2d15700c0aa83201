"""Exec, Attach and PortForward: validate, then hand out a single-use streaming URL."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def exec_(
    view: RuntimeView, request: api_pb2.ExecRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ExecResponse:
    view.containers.get_running(request.container_id)
    return api_pb2.ExecResponse(url=(await view.streaming.server()).get_exec_url(request))


async def attach(
    view: RuntimeView, request: api_pb2.AttachRequest, context: grpc.aio.ServicerContext
) -> api_pb2.AttachResponse:
    view.containers.get_running(request.container_id)
    return api_pb2.AttachResponse(url=(await view.streaming.server()).get_attach_url(request))


async def port_forward(
    view: RuntimeView, request: api_pb2.PortForwardRequest, context: grpc.aio.ServicerContext
) -> api_pb2.PortForwardResponse:
    view.pods.netns_of(request.pod_sandbox_id)
    server = await view.streaming.server()
    return api_pb2.PortForwardResponse(url=server.get_portforward_url(request))
