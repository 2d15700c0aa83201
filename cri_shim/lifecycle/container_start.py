"""StartContainer: a created container's process is let go."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from cri_shim.errors import CriError, FailedPrecondition
from cri_shim.faults import fault_point
from cri_shim.lifecycle.container_exits import ContainerExits
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.events import CONTAINER_STARTED, EventBus
from cri_shim.lifecycle.pods import Pods
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.state.containers import CREATED, RUNNING, ContainerRepository
from cri_shim.state.records import ContainerRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks
    from cri_shim.runtime.conmon import RuntimeBackend

log = logging.getLogger("cri_shim.container")


class ContainerStart:
    def __init__(
        self,
        rows: ContainerRepository,
        containers: VisibleContainers,
        pods: Pods,
        handlers: RuntimeHandlers,
        exits: ContainerExits,
        events: EventBus,
        nri: NriHooks | None,
    ) -> None:
        self._rows = rows
        self._containers = containers
        self._pods = pods
        self._handlers = handlers
        self._exits = exits
        self._events = events
        self._nri = nri

    async def start(self, ref: str) -> None:
        container = self._containers.get(ref)
        if container.state != CREATED:
            why = f" ({container.message})" if container.message else ""
            raise FailedPrecondition(
                f"container {container.id} is {container.state}, only a created container "
                f"can start{why}"
            )
        sandbox = self._pods.get(container.sandbox_id)
        backend = self._handlers.backend(sandbox.runtime_handler)
        await self._refuse_unmonitored(container, backend)
        # Taken before the start: a process that exits at once must not look as if it
        # finished before it started.
        started_at = time.time_ns()
        if self._nri is not None and self._nri.enabled:
            from cri_shim.nri.objects import container_of_record, pod_of_record

            await self._nri.start_container(pod_of_record(sandbox), container_of_record(container))
        try:
            await backend.start(container.id)
        except CriError:
            await self._refuse_unmonitored(container, backend)
            # A start whose answer was lost (the daemon died after `runc start` and before
            # the row said so): the runtime knows better than the row.
            if await backend.state(container.id) not in ("running", "stopped"):
                raise
            log.warning("container %s (%s) was already started", container.id, container.name)
        fault_point("container:started")
        container = self.mark_started(container, started_at)
        if self._nri is not None and self._nri.enabled:
            from cri_shim.nri.api import api_pb2 as nri_api
            from cri_shim.nri.objects import container_of_record, pod_of_record

            await self._nri.container_event(
                nri_api.POST_START_CONTAINER, pod_of_record(sandbox), container_of_record(container)
            )

    async def _refuse_unmonitored(
        self, container: ContainerRecord, backend: RuntimeBackend
    ) -> None:
        """A created container whose conmon is gone can never run (nobody would hold its
        stdio or record its exit): it is ended as the monitor's watch ends it (which may
        not have noticed yet), recorded exited with why, and its start refused."""
        if not backend.monitor_gone(container.id):
            return
        if backend.exit_status(container.id) is None:
            await backend.end_unmonitored(container.id)
        elif not backend.monitor_died(container.id):
            return  # conmon recorded an exit and left: its process ran
        self._exits.record(container, backend)
        raise FailedPrecondition(
            f"container {container.id} cannot start: its monitor (conmon) died before it "
            "was started"
        )

    def mark_started(self, container: ContainerRecord, started_at: int) -> ContainerRecord:
        """Record the start; the container as it is then."""
        self._rows.mark_running(container.id, started_at)
        log.info("container %s (%s) started", container.id, container.name)
        self._events.emit(container.id, container.sandbox_id, CONTAINER_STARTED)
        # A process that exited at once wrote its exit file before the row said running;
        # the exit watcher found nothing to do then, so look now.
        self._exits.notice(container.id)
        return replace(container, state=RUNNING, started_at=started_at)
