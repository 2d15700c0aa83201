"""Pod sandboxes: one object that every sandbox operation is reached through.

Each operation lives in a module named after its RPC: sandbox_run (RunPodSandbox, its
undo actions), sandbox_stop (StopPodSandbox, and a pod whose pause process exited),
sandbox_remove (RemovePodSandbox). pods.py has the visible pods that every one of them,
and the container lifecycle, looks a pod up in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cri_shim import tracing
from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.lifecycle.events import EventBus
from cri_shim.lifecycle.object_locks import ObjectLocks
from cri_shim.lifecycle.pause import SandboxContainers
from cri_shim.lifecycle.persisted_creation import restore_creations
from cri_shim.lifecycle.pods import PodContainers, Pods
from cri_shim.lifecycle.sandbox_remove import SandboxRemove
from cri_shim.lifecycle.sandbox_run import SandboxRun
from cri_shim.lifecycle.sandbox_stop import SandboxStop
from cri_shim.network.cni import CniNetwork
from cri_shim.network.netns import NamespacePinner
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.state.records import SandboxRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

__all__ = ["PodContainers", "Pods", "SandboxLifecycle"]


class SandboxLifecycle:
    """Every sandbox operation, each delegated to the module that owns it."""

    def __init__(
        self,
        config: Config,
        pods: Pods,
        journal: Journal,
        ledger: Ledger,
        pinner: NamespacePinner,
        cni: CniNetwork,
        *,
        events: EventBus,
        containers: PodContainers,
        handler_features: Callable[[str], HandlerFeatures],
        pause: SandboxContainers | None = None,
        nri: NriHooks | None = None,
        tracer: tracing.Tracer = tracing.NO_TRACER,
    ) -> None:
        self.pods = pods
        self.rows = pods.rows
        self.pinner = pinner
        # Shared with the container lifecycle: GetContainerEvents streams both.
        self.events = events
        self.pause = pause
        self._journal = journal
        self._cleanup_budget = config.creation.cleanup_timeout
        self._cni = cni
        self._run = SandboxRun(
            config,
            pods.rows,
            journal,
            ledger,
            pinner,
            cni,
            events=events,
            containers=containers,
            handler_features=handler_features,
            pause=pause,
            nri=nri,
            tracer=tracer,
        )
        self.coordinator = self._run.coordinator
        # Shared by stop and removal: a pod is stopped or removed by one call at a time.
        locks = ObjectLocks()
        self._stop = SandboxStop(config, pods, journal, events, containers, pause, locks)
        self._remove = SandboxRemove(
            config, pods, journal, events, containers, self.coordinator, locks, nri
        )

    # ---- operations ------------------------------------------------------------------

    async def run(
        self, config: api_pb2.PodSandboxConfig, runtime_handler: str, deadline: float | None
    ) -> str:
        return await self._run.run(config, runtime_handler, deadline)

    async def stop(self, sandbox_ref: str) -> None:
        await self._stop.stop(sandbox_ref)

    async def remove(self, sandbox_ref: str) -> None:
        await self._remove.remove(sandbox_ref)

    async def restore(self) -> None:
        """Before serving: roll back interrupted creations, re-register the rest."""
        await restore_creations(self.rows, self.coordinator, self._journal, self._cleanup_budget)

    def notice_exit(self, sandbox_id: str | None) -> None:
        self._stop.notice_exit(sandbox_id)

    def mark_not_ready(self, sandbox_id: str) -> None:
        self._stop.mark_not_ready(sandbox_id)

    # ---- queries (visible sandboxes only) ------------------------------------------

    def find(self, ref: str) -> SandboxRecord | None:
        return self.pods.find(ref)

    def get(self, ref: str) -> SandboxRecord:
        return self.pods.get(ref)

    def list(self) -> list[SandboxRecord]:
        return self.pods.list()

    def ids(self) -> set[str]:
        """Every sandbox with a row, whatever its phase."""
        return self.rows.ids()

    # ---- the network -----------------------------------------------------------------

    def network_status(self) -> tuple[bool, str, str]:
        return self._cni.status()

    def reload_network(self) -> None:
        """Re-read the CNI configuration now (SIGHUP, `systemctl reload`)."""
        self._cni.reload()
