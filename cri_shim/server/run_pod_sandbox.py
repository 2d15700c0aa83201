"""RunPodSandbox: the pod made by lifecycle/sandbox_run.py, which reserves its name and keeps
the work when the request gives up."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server.rpc import request_deadline

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def run_pod_sandbox(
    view: RuntimeView, request: api_pb2.RunPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RunPodSandboxResponse:
    sandbox_id = await view.sandboxes.run(
        request.config, request.runtime_handler, request_deadline(context)
    )
    return api_pb2.RunPodSandboxResponse(pod_sandbox_id=sandbox_id)
