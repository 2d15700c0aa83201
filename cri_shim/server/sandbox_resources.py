"""UpdatePodSandboxResources (in-place pod resize: the pod's total and its overhead).

With NRI, plugins are asked first (UpdatePodSandbox, which they may refuse) and told once
the resize is recorded (PostUpdatePodSandbox), as containerd does.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition
from cri_shim.lifecycle.pod_resources import record_pod_resources
from cri_shim.nri.adjust import nri_resources_of
from cri_shim.nri.objects import pod_of_record

if TYPE_CHECKING:
    from cri_shim.server.components import Components


async def update_pod_sandbox_resources(
    services: Components,
    request: api_pb2.UpdatePodSandboxResourcesRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdatePodSandboxResourcesResponse:
    sandbox = services.sandboxes.get(request.pod_sandbox_id)
    overhead = request.overhead if request.HasField("overhead") else None
    resources = request.resources if request.HasField("resources") else None
    nri = services.nri if services.nri is not None and services.nri.enabled else None
    if nri is not None:
        if not sandbox.ready:  # refused before plugins hear of it
            raise FailedPrecondition(f"pod sandbox {sandbox.id} is not ready (it was stopped)")
        pod = pod_of_record(sandbox)
        await nri.update_pod(
            pod,
            nri_resources_of(overhead) if overhead is not None else None,
            nri_resources_of(resources) if resources is not None else None,
        )
    await asyncio.to_thread(record_pod_resources, sandbox, overhead, resources)
    if nri is not None:
        await nri.pod_updated(pod)
    return api_pb2.UpdatePodSandboxResourcesResponse()
