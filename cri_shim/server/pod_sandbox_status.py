"""PodSandboxStatus: a pod's status and its containers' (lifecycle/statuses.py); verbose adds
its paths and recorded resources."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.statuses import to_pod_sandbox_status, to_status

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def pod_sandbox_status(
    view: RuntimeView,
    request: api_pb2.PodSandboxStatusRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.PodSandboxStatusResponse:
    sandbox = view.sandboxes.get(request.pod_sandbox_id)
    response = api_pb2.PodSandboxStatusResponse(status=to_pod_sandbox_status(sandbox))
    if request.verbose:
        info = {
            "id": sandbox.id,
            "name": sandbox.name,
            "runtimeHandler": sandbox.runtime_handler,
            "sandboxDir": str(sandbox.sandbox_dir),
            "netns": str(sandbox.netns_path or ""),
            "ipcns": str(sandbox.ipc_path or ""),
            "utsns": str(sandbox.uts_path or ""),
            "userns": str(sandbox.userns_path or ""),
            "ips": sandbox.ips,
            "cniResult": sandbox.cni_result,
            "hostNetwork": sandbox.host_network,
            "resources": await view.pod_resources.recorded(sandbox),
        }
        response.info["info"] = json.dumps(info, sort_keys=True)
    # Evented PLEG (kubelet) reads the pod's container statuses from this response.
    response.containers_statuses.extend(container_statuses(view, sandbox.id))
    return response


def container_statuses(view: RuntimeView, sandbox_id: str) -> list[api_pb2.ContainerStatus]:
    return [to_status(c) for c in view.containers.list(sandbox_id=sandbox_id)]
