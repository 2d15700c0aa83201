"""Containers: one object that every container operation is reached through.

Each operation lives in a module named after its RPC, as containerd names its files:
container_create (CreateContainer, its undo actions), container_start, container_stop,
container_remove, container_exec (ExecSync, Exec, Attach), container_update
(UpdateContainerResources). What they share: container_queries (the visible containers),
container_exits (exits read from conmon's files, recorded once) and runtime_handlers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cri_shim import tracing
from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.container_create import ContainerCreate
from cri_shim.lifecycle.container_exec import ContainerExec
from cri_shim.lifecycle.container_exits import ContainerExits
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.container_remove import ContainerRemove
from cri_shim.lifecycle.container_start import ContainerStart
from cri_shim.lifecycle.container_stop import ContainerStop
from cri_shim.lifecycle.container_update import ContainerUpdate
from cri_shim.lifecycle.events import EventBus
from cri_shim.lifecycle.pause import SandboxContainers
from cri_shim.lifecycle.persisted_creation import restore_creations
from cri_shim.lifecycle.pods import Pods
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.runtime.oci import ExecResult
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.journal import Journal
from cri_shim.state.records import ContainerRecord
from cri_shim.streaming.backend import ContainerEndpoint

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

__all__ = ["ContainerLifecycle"]


class ContainerLifecycle:
    """Every container operation, each delegated to the module that owns it."""

    def __init__(
        self,
        config: Config,
        rows: ContainerRepository,
        pods: Pods,
        journal: Journal,
        images: ImageStore,
        backends: dict[str, RuntimeBackend],
        *,
        events: EventBus,
        pause: SandboxContainers | None = None,
        nri: NriHooks | None = None,
        tracer: tracing.Tracer = tracing.NO_TRACER,
    ) -> None:
        self.rows = rows
        self.backends = backends
        self.events = events
        self._journal = journal
        self._cleanup_budget = config.creation.cleanup_timeout
        handlers = RuntimeHandlers(backends, config.runtime.default_handler, pods.rows)
        self._handlers = handlers
        exits = ContainerExits(rows, handlers, events, nri)
        self._exits = exits
        visible = VisibleContainers(rows, exits)
        self._visible = visible
        self._create = ContainerCreate(
            config, rows, pods, journal, images, handlers, events, pause, nri, tracer
        )
        self.coordinator = self._create.coordinator
        self.apparmor = self._create.apparmor
        self._start = ContainerStart(rows, visible, pods, handlers, exits, events, nri)
        self._stop = ContainerStop(visible, images, handlers, exits, nri)
        self._remove = ContainerRemove(rows, visible, self._stop, self.coordinator, events, nri)
        self._exec = ContainerExec(visible, handlers)
        self._update = ContainerUpdate(visible, pods, handlers, nri)

    # ---- operations ------------------------------------------------------------------

    async def create(
        self, sandbox_ref: str, config: api_pb2.ContainerConfig, deadline: float | None
    ) -> str:
        return await self._create.create(sandbox_ref, config, deadline)

    async def start(self, ref: str) -> None:
        await self._start.start(ref)

    async def stop(self, ref: str, timeout: float) -> None:
        await self._stop.stop(ref, timeout)

    async def remove(self, ref: str) -> None:
        await self._remove.remove(ref)

    async def stop_all_in(self, sandbox_id: str) -> None:
        await self._stop.stop_all_in(sandbox_id)

    async def remove_all_in(self, sandbox_id: str) -> None:
        await self._remove.remove_all_in(sandbox_id)

    async def exec_sync(self, ref: str, cmd: list[str], timeout: float) -> ExecResult:
        return await self._exec.exec_sync(ref, cmd, timeout)

    def streaming_endpoint(self, ref: str) -> ContainerEndpoint:
        return self._exec.streaming_endpoint(ref)

    async def reopen_log(self, ref: str) -> None:
        # One runtime call: conmon opens the log file afresh.
        container = self._visible.get_running(ref)
        await self._handlers.backend_of(container).reopen_log(container.id)

    async def update_resources(
        self, ref: str, resources: api_pb2.LinuxContainerResources | Mapping[str, Any]
    ) -> None:
        await self._update.update_resources(ref, resources)

    async def restore(self) -> None:
        """Before serving: roll back interrupted creations, re-register the rest, and read
        the exits of containers that exited while the daemon was down."""
        await restore_creations(self.rows, self.coordinator, self._journal, self._cleanup_budget)
        self._exits.notice(None)

    # ---- exits -----------------------------------------------------------------------

    def notice_exit(self, container_id: str | None) -> None:
        self._exits.notice(container_id)

    def refresh(self, container: ContainerRecord) -> ContainerRecord:
        return self._exits.refresh(container)

    def mark_started(self, container: ContainerRecord, started_at: int) -> ContainerRecord:
        return self._start.mark_started(container, started_at)

    def mark_lost(self, container: ContainerRecord) -> None:
        self._exits.mark_lost(container)

    # ---- queries (visible containers only) -----------------------------------------

    def find(self, ref: str) -> ContainerRecord | None:
        return self._visible.find(ref)

    def get(self, ref: str) -> ContainerRecord:
        return self._visible.get(ref)

    def get_running(self, ref: str) -> ContainerRecord:
        return self._visible.get_running(ref)

    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        return self._visible.list(sandbox_id)

    def ids(self) -> set[str]:
        """Every container with a row, whatever its phase."""
        return self.rows.ids()

    def backend_of(self, container: ContainerRecord) -> RuntimeBackend:
        return self._handlers.backend_of(container)

    def features_of(self, handler: str) -> HandlerFeatures:
        """What a runtime handler supports (probed once, then remembered)."""
        return self._handlers.features_of(handler)
