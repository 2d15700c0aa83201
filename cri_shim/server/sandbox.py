"""RunPodSandbox, StopPodSandbox, RemovePodSandbox, PodSandboxStatus, ListPodSandbox and
StreamPodSandboxes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.server import listing
from cri_shim.server.container import to_status
from cri_shim.server.listing import selected
from cri_shim.server.rpc import request_deadline
from cri_shim.state.records import SandboxRecord

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView


async def run_pod_sandbox(
    view: RuntimeView, request: api_pb2.RunPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RunPodSandboxResponse:
    sandbox_id = await view.sandboxes.run(
        request.config, request.runtime_handler, request_deadline(context)
    )
    return api_pb2.RunPodSandboxResponse(pod_sandbox_id=sandbox_id)


async def stop_pod_sandbox(
    view: RuntimeView, request: api_pb2.StopPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StopPodSandboxResponse:
    await view.sandboxes.stop(request.pod_sandbox_id)
    return api_pb2.StopPodSandboxResponse()


async def remove_pod_sandbox(
    view: RuntimeView,
    request: api_pb2.RemovePodSandboxRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.RemovePodSandboxResponse:
    await view.sandboxes.remove(request.pod_sandbox_id)
    return api_pb2.RemovePodSandboxResponse()


def _state(sandbox: SandboxRecord) -> api_pb2.PodSandboxState.ValueType:
    return api_pb2.SANDBOX_READY if sandbox.ready else api_pb2.SANDBOX_NOTREADY


def to_pod_sandbox_status(sandbox: SandboxRecord) -> api_pb2.PodSandboxStatus:
    """The CRI status of a sandbox (PodSandboxStatus, and each container event). Made once
    per record and shared: a message's constructor and extend() copy it; never change it."""
    return sandbox.derived(_pod_sandbox_status)


def _pod_sandbox_status(sandbox: SandboxRecord) -> api_pb2.PodSandboxStatus:
    config = sandbox.config
    network = api_pb2.PodSandboxNetworkStatus()
    if sandbox.ips and sandbox.ready:
        network.ip = sandbox.ips[0]
        network.additional_ips.extend(api_pb2.PodIP(ip=ip) for ip in sandbox.ips[1:])
    return api_pb2.PodSandboxStatus(
        id=sandbox.id,
        metadata=config.metadata,
        state=_state(sandbox),
        created_at=sandbox.created_at,
        network=network,
        linux=api_pb2.LinuxPodSandboxStatus(
            namespaces=api_pb2.Namespace(options=config.linux.security_context.namespace_options)
        ),
        labels=config.labels,
        annotations=config.annotations,
        runtime_handler=sandbox.runtime_handler,
    )


def to_pod_sandbox(sandbox: SandboxRecord) -> api_pb2.PodSandbox:
    """A sandbox as ListPodSandbox lists it; made once per record and shared, as
    to_pod_sandbox_status() is."""
    return sandbox.derived(_pod_sandbox)


def _pod_sandbox(sandbox: SandboxRecord) -> api_pb2.PodSandbox:
    config = sandbox.config
    return api_pb2.PodSandbox(
        id=sandbox.id,
        metadata=config.metadata,
        state=_state(sandbox),
        created_at=sandbox.created_at,
        labels=config.labels,
        annotations=config.annotations,
        runtime_handler=sandbox.runtime_handler,
    )


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


def pod_sandboxes_listed(
    view: RuntimeView, f: api_pb2.PodSandboxFilter
) -> Iterator[api_pb2.PodSandbox]:
    """The sandboxes `f` selects, one at a time: ListPodSandbox and StreamPodSandboxes."""
    for sandbox in view.sandboxes.list():
        if selected(f, sandbox.id, sandbox.config.labels, _state(sandbox)):
            yield to_pod_sandbox(sandbox)


async def list_pod_sandbox(
    view: RuntimeView, request: api_pb2.ListPodSandboxRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ListPodSandboxResponse:
    items = await listing.collect(
        pod_sandboxes_listed(view, request.filter),
        "ListPodSandbox",
        "StreamPodSandboxes",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListPodSandboxResponse(items=items)


async def stream_pod_sandboxes(
    view: RuntimeView,
    request: api_pb2.StreamPodSandboxesRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        pod_sandboxes_listed(view, request.filter),
        context,
        lambda s: api_pb2.StreamPodSandboxesResponse(pod_sandboxes=[s]),
    )
