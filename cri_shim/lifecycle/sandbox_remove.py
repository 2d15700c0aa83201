"""RemovePodSandbox: the pod's containers, then every step of its journal, then its rows
and its name."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from cri_shim.config import Config
from cri_shim.creation.coordinator import CreationCoordinator
from cri_shim.lifecycle.events import CONTAINER_DELETED, EventBus
from cri_shim.lifecycle.object_locks import ObjectLocks
from cri_shim.lifecycle.pods import PodContainers, Pods
from cri_shim.state.journal import Journal, UndoFailed

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

log = logging.getLogger("cri_shim.sandbox")


class SandboxRemove:
    def __init__(
        self,
        config: Config,
        pods: Pods,
        journal: Journal,
        events: EventBus,
        containers: PodContainers,
        coordinator: CreationCoordinator,
        locks: ObjectLocks,
        nri: NriHooks | None = None,
    ) -> None:
        self._locks = locks
        self._nri = nri
        self._budget = config.creation.cleanup_timeout
        self._pods = pods
        self._journal = journal
        self._events = events
        self._containers = containers
        self._coordinator = coordinator

    async def remove(self, sandbox_ref: str) -> None:
        # One stop or removal of a pod at a time: a second removal waits for the first
        # and then finds the pod gone, so the pod is undone and announced deleted once.
        async with self._locks.current(self._pods.find, sandbox_ref) as sandbox:
            if sandbox is None:
                return  # an absent pod is removed already, as the CRI says
            await self._containers.remove_all_in(sandbox.id)
            # The pod stays listed through its teardown; NRI plugins that connect meanwhile
            # are synchronized with it only until its RemovePodSandbox is told.
            removing = (
                self._nri.removing_pod(sandbox.id)
                if self._nri is not None
                else contextlib.nullcontext()
            )
            with removing:
                try:
                    await self._journal.undo(sandbox.id, budget=self._budget)
                except UndoFailed as exc:
                    log.error(
                        "sandbox %s (%s): removal left work for GC: %s",
                        sandbox.id,
                        sandbox.name,
                        exc,
                    )
                # Before the rows go: the event carries the pod's last status.
                self._events.emit(sandbox.id, sandbox.id, CONTAINER_DELETED)
                self._pods.rows.forget(sandbox.id)
            self._coordinator.release(sandbox.name, object_id=sandbox.id)
            log.info("sandbox %s (%s) removed", sandbox.id, sandbox.name)
