"""Visible pods by reference, and what a pod's stop and removal ask of its containers.

Both sit apart from the sandbox lifecycle so that the container lifecycle can use the one
and implement the other without either lifecycle knowing the other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from cri_shim.errors import FailedPrecondition, NotFound
from cri_shim.state.records import SandboxRecord
from cri_shim.state.sandboxes import SandboxRepository


def require_ready(sandbox: SandboxRecord) -> SandboxRecord:
    """`sandbox`, if it is ready; what a call that needs its namespaces is told if not."""
    if not sandbox.ready:
        raise FailedPrecondition(f"pod sandbox {sandbox.id} is not ready (it was stopped)")
    return sandbox


class PodContainers(Protocol):
    """What a pod's stop and removal do to its containers (the container lifecycle)."""

    async def stop_all_in(self, sandbox_id: str) -> None: ...

    async def remove_all_in(self, sandbox_id: str) -> None: ...


class Pods:
    """Visible sandboxes by reference, for what acts on a pod (its containers, its
    port-forwards). Reads rows only, so that it exists before the lifecycles do."""

    def __init__(
        self,
        rows: SandboxRepository,
        forwardable: Callable[[SandboxRecord], None] | None = None,
    ) -> None:
        self.rows = rows
        # Refuses port-forward into a pod whose runtime cannot serve it (gVisor's netstack).
        self._forwardable = forwardable

    def find(self, ref: str) -> SandboxRecord | None:
        return self.rows.find_visible(ref)

    def get(self, ref: str) -> SandboxRecord:
        sandbox = self.find(ref)
        if sandbox is None:
            raise NotFound(f"pod sandbox {ref!r} not found")
        return sandbox

    def get_ready(self, ref: str) -> SandboxRecord:
        return require_ready(self.get(ref))

    def list(self) -> list[SandboxRecord]:
        return self.rows.list_visible()

    def netns_of(self, ref: str) -> Path | None:
        """The pinned network namespace of a ready pod (port-forward dials into it); None
        for a host-network pod, which shares the daemon's own."""
        sandbox = self.get_ready(ref)
        if self._forwardable is not None:
            self._forwardable(sandbox)
        return sandbox.netns_path
