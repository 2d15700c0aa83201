"""StopPodSandbox, and a pod that stops being ready on its own (its pause process exited).

A stopped pod keeps its directory and rows until RemovePodSandbox; what it loses is what
its containers ran in: the network, the pinned namespaces, /dev/shm, the pause process.
"""

from __future__ import annotations

import logging

from cri_shim.config import Config
from cri_shim.lifecycle.events import CONTAINER_STOPPED, EventBus
from cri_shim.lifecycle.object_locks import ObjectLocks
from cri_shim.lifecycle.pause import PAUSE_ACTION, SandboxContainers
from cri_shim.lifecycle.pods import PodContainers, Pods
from cri_shim.logcontext import object_fields
from cri_shim.nri.actions import POD_STOPPED as NRI_POD_STOPPED
from cri_shim.state.journal import Journal, UndoFailed

log = logging.getLogger("cri_shim.sandbox")

# Steps that StopPodSandbox undoes; the directory and the rows stay until RemovePodSandbox.
# NRI's StopPodSandbox, journaled last, is undone first: plugins hear of the stop before
# the network goes.
STOP_ACTIONS = (NRI_POD_STOPPED, "cni_del", "unpin", "unmount", PAUSE_ACTION)


class SandboxStop:
    def __init__(
        self,
        config: Config,
        pods: Pods,
        journal: Journal,
        events: EventBus,
        containers: PodContainers,
        pause: SandboxContainers | None,
        locks: ObjectLocks,
    ) -> None:
        self._locks = locks
        self._budget = config.network.teardown_timeout
        self._pods = pods
        self._journal = journal
        self._events = events
        self._containers = containers
        self._pause = pause

    async def stop(self, sandbox_ref: str) -> None:
        # One stop or removal of a pod at a time: two would run its undo steps twice.
        async with self._locks.current(self._pods.find, sandbox_ref) as sandbox:
            if sandbox is None:
                # kubelet retries stop for pods it forgot about (or it was removed while
                # this call waited): unknown is success.
                return
            # The containers first: they run in what the undo steps take away.
            await self._containers.stop_all_in(sandbox.id)
            try:
                await self._journal.undo(sandbox.id, only=STOP_ACTIONS, budget=self._budget)
            except UndoFailed as exc:
                # Queued for garbage collection; the pod is stopped all the same.
                log.error(
                    "sandbox %s (%s): stop left work for GC: %s", sandbox.id, sandbox.name, exc
                )
            self.mark_not_ready(sandbox.id)
            log.info("sandbox %s (%s) stopped", sandbox.id, sandbox.name)

    def mark_not_ready(self, sandbox_id: str) -> None:
        # One event per transition, whoever noticed it first.
        if self._pods.rows.mark_not_ready(sandbox_id):
            self._events.emit(sandbox_id, sandbox_id, CONTAINER_STOPPED)

    def notice_exit(self, sandbox_id: str | None) -> None:
        """An exit file appeared (None: some may have been missed). When it is the pause
        process of a ready pod, the pod has lost its PID namespace and every process in
        it: it is not ready any more, and kubelet will recreate it."""
        if self._pause is None:
            return
        if sandbox_id is None:
            sandboxes = self._pods.list()
        else:
            visible = self._pods.rows.visible(sandbox_id)
            sandboxes = [visible] if visible is not None else []
        for sandbox in sandboxes:
            if sandbox.ready and self._pause.exited(sandbox):
                log.warning(
                    "sandbox %s (%s): its pause process exited; the pod is not ready",
                    sandbox.id,
                    sandbox.name,
                    extra=object_fields("sandbox", sandbox.id, sandbox.name),
                )
                self.mark_not_ready(sandbox.id)
