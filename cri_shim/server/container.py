"""CreateContainer, Start/Stop/Remove, List and Stream, ContainerStatus, ExecSync, logs,
resources."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from cri_shim.api.v1 import api_pb2
from cri_shim.inspection.runtime_spec import process_user_of, runtime_spec_of
from cri_shim.server import listing
from cri_shim.server.listing import selected
from cri_shim.server.rpc import request_deadline
from cri_shim.state.records import ContainerRecord

if TYPE_CHECKING:
    from cri_shim.server.views import RuntimeView

_STATES = {
    "created": api_pb2.CONTAINER_CREATED,
    "running": api_pb2.CONTAINER_RUNNING,
    "exited": api_pb2.CONTAINER_EXITED,
}


def container_state(container: ContainerRecord) -> api_pb2.ContainerState.ValueType:
    return _STATES.get(container.state, api_pb2.CONTAINER_UNKNOWN)


async def create_container(
    view: RuntimeView, request: api_pb2.CreateContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.CreateContainerResponse:
    container_id = await view.containers.create(
        request.pod_sandbox_id, request.config, request_deadline(context)
    )
    return api_pb2.CreateContainerResponse(container_id=container_id)


async def start_container(
    view: RuntimeView, request: api_pb2.StartContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StartContainerResponse:
    await view.containers.start(request.container_id)
    return api_pb2.StartContainerResponse()


async def stop_container(
    view: RuntimeView, request: api_pb2.StopContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.StopContainerResponse:
    await view.containers.stop(request.container_id, float(request.timeout))
    return api_pb2.StopContainerResponse()


async def remove_container(
    view: RuntimeView, request: api_pb2.RemoveContainerRequest, context: grpc.aio.ServicerContext
) -> api_pb2.RemoveContainerResponse:
    await view.containers.remove(request.container_id)
    return api_pb2.RemoveContainerResponse()


def image_spec(container: ContainerRecord) -> api_pb2.ImageSpec:
    """The image as the user named it: kubelet shows `image` in the pod's status."""
    name = container.image_ref
    return api_pb2.ImageSpec(image=name, user_specified_image=name)


def to_container(container: ContainerRecord) -> api_pb2.Container:
    """A container as ListContainers lists it. Made once per record and shared: a
    message's constructor and extend() copy it; never change it."""
    return container.derived(_container)


def _container(container: ContainerRecord) -> api_pb2.Container:
    return api_pb2.Container(
        id=container.id,
        pod_sandbox_id=container.sandbox_id,
        metadata=container.config.metadata,
        image=image_spec(container),
        image_ref=container.repo_digest or container.image_id,
        image_id=container.image_id,
        state=container_state(container),
        created_at=container.created_at,
        labels=container.config.labels,
        annotations=container.config.annotations,
    )


def containers_listed(view: RuntimeView, f: api_pb2.ContainerFilter) -> Iterator[api_pb2.Container]:
    """The containers `f` selects, one at a time: ListContainers and StreamContainers."""
    for container in view.containers.list(sandbox_id=f.pod_sandbox_id or None):
        if selected(f, container.id, container.config.labels, container_state(container)):
            yield to_container(container)


async def list_containers(
    view: RuntimeView, request: api_pb2.ListContainersRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ListContainersResponse:
    items = await listing.collect(
        containers_listed(view, request.filter),
        "ListContainers",
        "StreamContainers",
        listing.reply_limit(view.config),
    )
    return api_pb2.ListContainersResponse(containers=items)


async def stream_containers(
    view: RuntimeView,
    request: api_pb2.StreamContainersRequest,
    context: grpc.aio.ServicerContext,
) -> None:
    await listing.stream(
        containers_listed(view, request.filter),
        context,
        lambda c: api_pb2.StreamContainersResponse(containers=[c]),
    )


def to_status(container: ContainerRecord) -> api_pb2.ContainerStatus:
    """ContainerStatus's status (and each container event's, and PodSandboxStatus's);
    made once per record and shared, as to_container() is."""
    return container.derived(_status)


def _status(container: ContainerRecord) -> api_pb2.ContainerStatus:
    config = container.config
    return api_pb2.ContainerStatus(
        id=container.id,
        metadata=config.metadata,
        state=container_state(container),
        created_at=container.created_at,
        started_at=container.started_at,
        finished_at=container.finished_at,
        exit_code=container.exit_code,
        image=image_spec(container),
        image_ref=container.repo_digest or container.image_id,
        image_id=container.image_id,
        reason=container.reason,
        message=container.message,
        labels=config.labels,
        annotations=config.annotations,
        mounts=status_mounts(config),
        log_path=container.log_path,
        user=container_user(container),
    )


def status_mounts(config: api_pb2.ContainerConfig) -> list[api_pb2.Mount]:
    """The container's mounts; an image volume's (resolved to its image ID when the
    container was made) carries that ID in image_ref too, where CRI 1.36 reads it."""
    mounts = []
    for mount in config.mounts:
        if mount.image.image and not mount.image.image_ref:
            copy = api_pb2.Mount()
            copy.CopyFrom(mount)
            copy.image.image_ref = mount.image.image
            mount = copy
        mounts.append(mount)
    return mounts


def container_user(container: ContainerRecord) -> api_pb2.ContainerUser | None:
    """Who the container's process runs as, as runc was told (the OCI spec's
    process.user): kubelet checks the effective supplemental groups against the pod's
    SupplementalGroupsPolicy. The primary group is listed too, as `id -G` lists it."""
    user = process_user_of(container)
    if user is None:
        return None  # no spec (yet): nothing to report rather than a guess
    gid = int(user.get("gid", 0))
    groups = list(dict.fromkeys([gid, *(int(g) for g in user.get("additionalGids") or [])]))
    return api_pb2.ContainerUser(
        linux=api_pb2.LinuxContainerUser(
            uid=int(user.get("uid", 0)), gid=gid, supplemental_groups=groups
        )
    )


async def container_status(
    view: RuntimeView, request: api_pb2.ContainerStatusRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ContainerStatusResponse:
    container = view.containers.get(request.container_id)
    response = api_pb2.ContainerStatusResponse(status=to_status(container))
    if request.verbose:
        info = {
            "id": container.id,
            "name": container.name,
            "sandboxID": container.sandbox_id,
            "pid": container.pid,
            "bundle": str(container.bundle_dir),
            "rootfs": str(container.rootfs),
            "runtimeSpec": await asyncio.to_thread(runtime_spec_of, container),
        }
        response.info["info"] = json.dumps(info, sort_keys=True)
    return response


async def exec_sync(
    view: RuntimeView, request: api_pb2.ExecSyncRequest, context: grpc.aio.ServicerContext
) -> api_pb2.ExecSyncResponse:
    result = await view.containers.exec_sync(
        request.container_id, list(request.cmd), float(request.timeout)
    )
    return api_pb2.ExecSyncResponse(
        stdout=result.stdout, stderr=result.stderr, exit_code=result.exit_code
    )


async def reopen_container_log(
    view: RuntimeView,
    request: api_pb2.ReopenContainerLogRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.ReopenContainerLogResponse:
    await view.containers.reopen_log(request.container_id)
    return api_pb2.ReopenContainerLogResponse()


async def update_container_resources(
    view: RuntimeView,
    request: api_pb2.UpdateContainerResourcesRequest,
    context: grpc.aio.ServicerContext,
) -> api_pb2.UpdateContainerResourcesResponse:
    await view.containers.update_resources(request.container_id, request.linux)
    return api_pb2.UpdateContainerResourcesResponse()
