"""Visible containers by reference, each with the exit conmon recorded since last asked:
what List and Status answer with, and what every operation looks its container up in."""

from __future__ import annotations

from cri_shim.errors import FailedPrecondition, NotFound
from cri_shim.lifecycle.container_exits import ContainerExits
from cri_shim.state.containers import RUNNING, ContainerRepository
from cri_shim.state.records import ContainerRecord


class VisibleContainers:
    def __init__(self, rows: ContainerRepository, exits: ContainerExits) -> None:
        self._rows = rows
        self._exits = exits

    def find(self, ref: str) -> ContainerRecord | None:
        container = self._rows.find_visible(ref)
        return self._exits.refresh(container) if container is not None else None

    def get(self, ref: str) -> ContainerRecord:
        container = self.find(ref)
        if container is None:
            raise NotFound(f"container {ref!r} not found")
        return container

    def get_running(self, ref: str) -> ContainerRecord:
        container = self.get(ref)
        if container.state != RUNNING:
            raise FailedPrecondition(f"container {container.id} is not running ({container.state})")
        return container

    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        if sandbox_id is None:
            containers = self._rows.list_visible()
        else:
            containers = self._rows.list_visible_in(sandbox_id)
        return self._exits.refresh_all(containers)
