"""Attach: a single-use streaming URL to a running container's stdio (streaming/)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def attach(
    view: RuntimeView, request: api_pb2.AttachRequest, context: grpc.aio.ServicerContext
) -> api_pb2.AttachResponse:
    view.containers.get_running(request.container_id)
    return api_pb2.AttachResponse(url=(await view.streaming.server()).get_attach_url(request))
