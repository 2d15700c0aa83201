"""UpdateContainerResources: a CRI update (told to NRI plugins, which may change or
refuse it) or an NRI plugin's own update, applied through the runtime."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import FailedPrecondition
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.pods import Pods
from cri_shim.lifecycle.resource_rules import check_resources
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.state.containers import EXITED

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks


class ContainerUpdate:
    def __init__(
        self,
        containers: VisibleContainers,
        pods: Pods,
        handlers: RuntimeHandlers,
        nri: NriHooks | None,
    ) -> None:
        self._containers = containers
        self._pods = pods
        self._handlers = handlers
        self._nri = nri

    async def update_resources(
        self, ref: str, resources: api_pb2.LinuxContainerResources | Mapping[str, Any]
    ) -> None:
        """A CRI update, or OCI LinuxResources (an NRI plugin's update)."""
        if isinstance(resources, api_pb2.LinuxContainerResources):
            field = "UpdateContainerResourcesRequest.linux"
            await asyncio.to_thread(check_resources, resources, field)  # reads sysfs
        container = self._containers.get(ref)
        if container.state == EXITED:
            raise FailedPrecondition(f"container {container.id} has exited")
        backend = self._handlers.backend_of(container)
        nri = self._nri
        if (
            nri is None
            or not nri.enabled
            or not isinstance(resources, api_pb2.LinuxContainerResources)
        ):
            # Plugins' own updates come as OCI resources and are not told back to them.
            await backend.update_resources(container.id, resources)
            return
        from cri_shim.nri.adjust import adjust_update, nri_resources_of
        from cri_shim.nri.api import api_pb2 as nri_api
        from cri_shim.nri.objects import container_of_record, pod_of_record

        # Plugins may change a CRI update before it is applied, or refuse it.
        pod, told = (
            pod_of_record(self._pods.get(container.sandbox_id)),
            container_of_record(container),
        )
        changes = await nri.update_container(pod, told, nri_resources_of(resources))
        if changes:
            changed = api_pb2.LinuxContainerResources()
            changed.CopyFrom(resources)
            adjust_update(changed, changes)
            resources = changed
        await backend.update_resources(container.id, resources)
        told.linux.resources.CopyFrom(nri_resources_of(resources))
        await nri.container_event(nri_api.POST_UPDATE_CONTAINER, pod, told)
