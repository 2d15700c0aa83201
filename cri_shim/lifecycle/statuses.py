"""Pods and containers as the CRI reports them, made where their records are.

A record is frozen, so each CRI item made from it (`to_container`, `to_status`,
`to_pod_sandbox`, `to_pod_sandbox_status`) is made once per record
(`RowSnapshot.derived`) and shared by List and Status replies and by events: a message's
constructor copies it, nothing changes it.

`EventMessages` renders a container event (GetContainerEvents) here, when the transition
happens, from the pod and containers the lifecycle holds: serialized once, and the same
bytes go to every subscriber; the edge only sends them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError
from cri_shim.lifecycle.events import ContainerEvent
from cri_shim.state.records import ContainerRecord, SandboxRecord

log = logging.getLogger("cri_shim.events")

_STATES = {
    "created": api_pb2.CONTAINER_CREATED,
    "running": api_pb2.CONTAINER_RUNNING,
    "exited": api_pb2.CONTAINER_EXITED,
}


def container_state(container: ContainerRecord) -> api_pb2.ContainerState.ValueType:
    return _STATES.get(container.state, api_pb2.CONTAINER_UNKNOWN)


def sandbox_state(sandbox: SandboxRecord) -> api_pb2.PodSandboxState.ValueType:
    return api_pb2.SANDBOX_READY if sandbox.ready else api_pb2.SANDBOX_NOTREADY


# --- containers ------------------------------------------------------------------------------
def image_spec(container: ContainerRecord) -> api_pb2.ImageSpec:
    """The image as the user named it: kubelet shows `image` in the pod's status."""
    name = container.image_ref
    return api_pb2.ImageSpec(image=name, user_specified_image=name)


def to_container(container: ContainerRecord) -> api_pb2.Container:
    """A container as ListContainers lists it; made once per record and shared."""
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


def process_user_of(container: ContainerRecord) -> dict[str, Any] | None:
    """The OCI spec's process.user: recorded in the row when the runtime made the
    container; a container made before the daemon recorded it has it read from its
    bundle (once per record: the status is derived once). None when there is no spec
    (yet), or it cannot be read."""
    try:
        if container.process_user:
            user = json.loads(container.process_user)
        else:
            spec = json.loads((container.bundle_dir / "config.json").read_text())
            user = spec["process"]["user"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return user if isinstance(user, dict) else None


# --- pods ------------------------------------------------------------------------------------
def to_pod_sandbox_status(sandbox: SandboxRecord) -> api_pb2.PodSandboxStatus:
    """The CRI status of a sandbox (PodSandboxStatus, and each container event); made once
    per record and shared."""
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
        state=sandbox_state(sandbox),
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
        state=sandbox_state(sandbox),
        created_at=sandbox.created_at,
        labels=config.labels,
        annotations=config.annotations,
        runtime_handler=sandbox.runtime_handler,
    )


# --- events ----------------------------------------------------------------------------------
class EventMessages:
    """The CRI message of an event, made when the event happens (the event bus's
    renderer): `sandbox_of` finds a visible pod, `containers_of` a pod's visible
    containers, both from the lifecycle's own records."""

    def __init__(
        self,
        sandbox_of: Callable[[str], SandboxRecord],
        containers_of: Callable[[str], list[ContainerRecord]],
    ) -> None:
        self._sandbox_of = sandbox_of
        self._containers_of = containers_of

    def __call__(self, event: ContainerEvent) -> bytes | None:
        """The serialized ContainerEventResponse, with the pod's status and its
        containers' statuses as they are at the moment of the transition: serialized
        once, and the same bytes go to every subscriber (services.py sends bytes as they
        are). None drops the event: kubelet ignores an event without a pod sandbox
        status, so there is no point in sending one."""
        try:
            sandbox = self._sandbox_of(event.sandbox_id)
        except CriError:
            log.debug("event %s of %s: its pod is gone", event.kind_name, event.container_id)
            return None
        return api_pb2.ContainerEventResponse(
            container_id=event.container_id,
            container_event_type=api_pb2.ContainerEventType.ValueType(event.kind),
            created_at=event.created_at,
            pod_sandbox_status=to_pod_sandbox_status(sandbox),
            containers_statuses=[to_status(c) for c in self._containers_of(sandbox.id)],
        ).SerializeToString()
