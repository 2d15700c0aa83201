"""The creation coordinator's persistence hooks, shared by sandboxes and containers.

Each hook writes the state database in the same step as the coordinator's in-memory
change, so that a restart finds reservations, stages and cached objects as they were.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cri_shim.creation.coordinator import CreationCoordinator, Phase
from cri_shim.logcontext import object_bound
from cri_shim.state.journal import Journal, UndoFailed
from cri_shim.state.objects import ObjectRepository

log = logging.getLogger("cri_shim.restore")


class PersistedCreationHooks:
    """The coordinator's decisions for one kind of object, written through its rows."""

    kind: str
    # Set by the subclass: the coordinator these hooks serve and the journal it undoes.
    coordinator: CreationCoordinator
    _journal: Journal
    _cleanup_budget: float

    def __init__(self, rows: ObjectRepository[Any]) -> None:
        self._rows = rows

    def reserve(self, name: str, object_id: str) -> None:
        self._rows.reserve_name(name, object_id)

    def stage_changed(self, object_id: str, stage: str) -> None:
        self._rows.set_stage(object_id, stage)

    def cached(self, object_id: str, expires_at: float) -> None:
        self._rows.mark_cached(object_id, _wall_clock(expires_at))

    def publish(self, object_id: str) -> None:
        self._rows.mark_visible(object_id)

    def mark_cleaning(self, object_id: str) -> None:
        """Before a cleanup's first await: a crash from here on must roll the object
        back at restart, never restore a half-undone object as claimable."""
        self._rows.mark_cleaning(object_id)

    def released(self, name: str, object_id: str) -> None:
        self._rows.release_name(name, object_id)

    def forget(self, object_id: str) -> None:
        """Drop the object's rows once its teardown has run."""
        self._rows.forget(object_id)

    async def restore_rows(self) -> None:
        """Before serving: roll back what a crash interrupted (a creation, or a cleanup),
        hand cached objects back to the coordinator with a fresh expiry, re-register the
        visible ones, and drop reservations that never got a row."""
        for row in self._rows.phases():
            with object_bound(self.kind, row.id, row.name):
                if row.phase == Phase.CACHED:
                    expires_at = self.coordinator.restore_cached(row.name, row.id)
                    self._rows.extend_cached(row.id, _wall_clock(expires_at))
                elif row.phase == Phase.VISIBLE:
                    self.coordinator.restore_visible(row.name, row.id)
                else:
                    log.warning(
                        "%s %s (%s): %s was interrupted; rolling it back",
                        self.kind,
                        row.id,
                        row.name,
                        row.phase,
                    )
                    try:
                        await self._journal.undo(row.id, budget=self._cleanup_budget)
                    except UndoFailed as exc:
                        log.error("%s %s: rollback left work for GC: %s", self.kind, row.id, exc)
                    self.forget(row.id)
        self._rows.drop_names_without_rows()


def _wall_clock(expires_at: float) -> float:
    """The coordinator's clock is the loop's; rows keep wall-clock time for humans."""
    return time.time() + max(0.0, expires_at - asyncio.get_running_loop().time())
