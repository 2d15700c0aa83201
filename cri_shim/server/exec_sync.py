"""ExecSync: a command run in a container to its end (lifecycle/container_exec.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def exec_sync(
    view: RuntimeView, request: api_pb2.ExecSyncRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ExecSyncResponse:
    result = await view.containers.exec_sync(
        request.container_id, list(request.cmd), float(request.timeout)
    )
    return api_pb2.ExecSyncResponse(
        stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code
    )
