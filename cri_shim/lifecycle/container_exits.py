"""Container exits: read from conmon's exit files and recorded once each.

An exit is noticed by whoever looks first (a stop, the exit watcher, a List or Status
call, restore); the row changes once, and only that change emits the stopped event.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from cri_shim.lifecycle.events import CONTAINER_STOPPED, EventBus
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.state.containers import CREATED, EXITED, RUNNING, ContainerRepository
from cri_shim.state.records import ContainerRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

log = logging.getLogger("cri_shim.container")

MONITOR_DIED_MESSAGE = (
    "the container's monitor (conmon) died without recording its exit: the container was "
    "killed and its exit code is unknown"
)
MONITOR_DIED_BEFORE_START = (
    "the container's monitor (conmon) died before it was started: the container was "
    "deleted from the runtime and never ran"
)


class ContainerExits:
    def __init__(
        self,
        rows: ContainerRepository,
        handlers: RuntimeHandlers,
        events: EventBus,
        nri: NriHooks | None,
    ) -> None:
        self._rows = rows
        self._handlers = handlers
        self._events = events
        self._nri = nri

    def record(self, container: ContainerRecord, backend: RuntimeBackend) -> ContainerRecord:
        """Record the exit conmon wrote (137 and now when it wrote none); the container
        as it is then."""
        status = backend.exit_status(container.id)
        code, finished = status if status is not None else (137, time.time_ns())
        # The exit file's mtime comes from the kernel's coarse clock, which can lag the
        # start time we took by a few milliseconds for a process that exits at once.
        finished = max(finished, container.started_at)
        message = None
        if backend.oom_killed(container.id):
            reason = "OOMKilled"
        elif code == 0:
            reason = "Completed"
        else:
            reason = "Error"
        if backend.monitor_died(container.id):
            # Written by the daemon in conmon's place (runtime/conmon_watch.py): containerd and
            # CRI-O report such an exit as 255, "Error"; the message says why.
            message = MONITOR_DIED_MESSAGE if container.started_at else MONITOR_DIED_BEFORE_START
        changed = self._rows.mark_exited(container.id, code, finished, reason, message)
        container = replace(
            container,
            state=EXITED,
            exit_code=code,
            finished_at=finished,
            reason=reason,
            message=container.message if message is None else message,
        )
        if changed:  # a stop and the exit watcher may both notice it; one event
            self._events.emit(container.id, container.sandbox_id, CONTAINER_STOPPED)
            if self._nri is not None:
                self._nri.container_exited(container.id)
        return container

    def mark_lost(self, container: ContainerRecord) -> None:
        log.warning(
            "container %s (%s): its process is gone and no exit was recorded",
            container.id,
            container.name,
        )
        self._rows.mark_exited(
            container.id,
            255,
            time.time_ns(),
            "Unknown",
            message="the container's process disappeared without an exit record (host reboot?)",
        )
        self._events.emit(container.id, container.sandbox_id, CONTAINER_STOPPED)

    def refresh(self, container: ContainerRecord) -> ContainerRecord:
        """Pick up an exit that conmon recorded since we last looked, and the end of a
        created container whose conmon died (it will never run)."""
        if container.state not in (RUNNING, CREATED):
            return container
        # Only the backend that runs it has its exit file: no need to look its handler
        # up (Status and List ask this of every container they answer with).
        for backend in self._handlers.backends.values():
            if backend.exit_status(container.id) is None:
                continue
            # A created container's exit file is only ever the daemon's, written when its
            # conmon died (a start under way may see its process's own exit first).
            if container.state == RUNNING or backend.monitor_died(container.id):
                return self.record(container, backend)
        return container

    def refresh_all(self, containers: list[ContainerRecord]) -> list[ContainerRecord]:
        """refresh() for many: each backend's exit files are listed once, and only the
        containers that have one are looked at. A file looked for per running container
        was a quarter of what a listing cost."""
        backends = self._handlers.backends.values()
        exited: set[str] = set().union(*(b.recorded_exits() for b in backends))
        return [
            self.refresh(c) if c.state in (RUNNING, CREATED) and c.id in exited else c
            for c in containers
        ]

    def notice(self, container_id: str | None) -> None:
        """conmon wrote an exit file (the exit watcher saw it): record the exit now, which
        emits the stopped event. None (events were lost) looks at every container."""
        if container_id is None:
            self.refresh_all(self._rows.list_visible())
            return
        container = self._rows.visible(container_id)
        if container is not None:
            # Not visible (being created, or cached): its exit is read when it is claimed.
            self.refresh(container)
