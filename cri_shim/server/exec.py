"""Exec: a single-use streaming URL for a command in a running container (streaming/)."""

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
