"""RemoveContainer: the container is hidden at once and torn down in the background
from its journal; and a pod's containers removed together (RemovePodSandbox)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cri_shim.creation.coordinator import CreationCoordinator
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.container_stop import ContainerStop
from cri_shim.lifecycle.events import CONTAINER_DELETED, EventBus
from cri_shim.lifecycle.object_locks import ObjectLocks
from cri_shim.state.containers import ContainerRepository

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

log = logging.getLogger("cri_shim.container")


class ContainerRemove:
    def __init__(
        self,
        rows: ContainerRepository,
        containers: VisibleContainers,
        stopper: ContainerStop,
        coordinator: CreationCoordinator,
        events: EventBus,
        nri: NriHooks | None,
    ) -> None:
        self._rows = rows
        self._containers = containers
        self._stopper = stopper
        self._coordinator = coordinator
        self._events = events
        self._nri = nri
        # Two removals of one container at once: the second waits for the first.
        self._locks = ObjectLocks()

    async def remove(self, ref: str) -> None:
        """Hide the container and answer; its teardown (runc delete, unmounts, its
        directory) runs in the coordinator's task group from the journal.

        The row says `cleaning` before this returns, so a crash from here on is rolled
        forward by restore, and the name and the row (so the ID) stay held until the
        teardown has ended (DESIGN §4).
        """
        async with self._locks.current(self._containers.find, ref) as container:
            if container is None:
                return  # absent, or hidden by a removal that held the lock first
            await self._stopper.stop_record(container, 0)
            # Hidden before plugins hear of the removal: a plugin that connects meanwhile
            # is synchronized with the container only while its removal is still to be
            # told to it (NriHooks).
            self._rows.mark_cleaning(container.id)
            try:
                if self._nri is not None:
                    # Plugins hear of the removal as kubelet does, before the teardown.
                    await self._nri.removed(container.id)
            finally:
                # Hidden, so torn down whatever happened to the telling: what was not
                # told is told by the teardown, which runs the rest of the journal.
                log.info("container %s (%s) removed; tearing down", container.id, container.name)
                self._events.emit(container.id, container.sandbox_id, CONTAINER_DELETED)
                self._coordinator.retire(container.name, object_id=container.id)

    async def remove_all_in(self, sandbox_id: str) -> None:
        """Remove the sandbox's containers and wait for every teardown among them, those
        of earlier RemoveContainer calls included: the sandbox's own undo comes next."""
        for container in self._containers.list(sandbox_id=sandbox_id):
            await self.remove(container.id)
        for row in self._rows.cleaning_in(sandbox_id):
            await self._coordinator.until_released(row.name, object_id=row.id)
