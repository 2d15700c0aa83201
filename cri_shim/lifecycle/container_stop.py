"""StopContainer: the stop signal, a grace period, then SIGKILL; and a pod's containers
stopped together (StopPodSandbox, RemovePodSandbox)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from cri_shim.errors import InvalidArgument
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.container_exits import ContainerExits
from cri_shim.lifecycle.container_images import image_config_view
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.runtime.spec import resolve_stop_signal
from cri_shim.state.containers import CREATED, EXITED
from cri_shim.state.records import ContainerRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

log = logging.getLogger("cri_shim.container")


class ContainerStop:
    def __init__(
        self,
        containers: VisibleContainers,
        images: ImageStore,
        handlers: RuntimeHandlers,
        exits: ContainerExits,
        nri: NriHooks | None,
    ) -> None:
        self._containers = containers
        self._images = images
        self._handlers = handlers
        self._exits = exits
        self._nri = nri

    async def stop(self, ref: str, timeout: float) -> None:
        container = self._containers.find(ref)
        if container is None:
            return
        await self.stop_record(container, timeout)

    async def stop_all_in(self, sandbox_id: str) -> None:
        containers = self._containers.list(sandbox_id=sandbox_id)
        await asyncio.gather(*(self.stop_record(c, 0) for c in containers))

    async def stop_record(self, container: ContainerRecord, timeout: float) -> None:
        container = self._exits.refresh(container)
        if container.state == EXITED:
            return
        backend = self._handlers.backend_of(container)
        if container.state == CREATED:
            # Never started: nothing to signal; the runtime container is torn down on remove.
            await backend.stop(container.id, 0, signal.SIGKILL)
        else:
            image = self._images.get(container.image_id)
            try:
                stop_signal = resolve_stop_signal(container.config, image_config_view(image))
            except InvalidArgument as err:
                # Created before stop signals were checked: nothing may make a container
                # unkillable.
                log.warning("container %s: %s; stopping it with SIGKILL", container.id, err)
                stop_signal, timeout = signal.SIGKILL, 0
            await backend.stop(container.id, max(0.0, timeout), stop_signal)
        container = self._exits.record(container, backend)
        log.info("container %s (%s) stopped", container.id, container.name)
        if self._nri is not None:
            await self._nri.settle(container.id)  # StopContainer answered before we are
