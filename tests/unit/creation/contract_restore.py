"""The restarts of the state machine and their invariant (creation/restore.py): a restart
rolls interrupted creations back, keeps visible objects' names and keeps cached objects
claimable, with an expiry that starts again at the restart.
"""

from __future__ import annotations

from contract_cache import CacheContract
from contract_machine import GRACE, MAX_RESTARTS, NAMES
from hypothesis import event
from hypothesis.stateful import invariant, precondition, rule

from cri_shim.creation.coordinator import Phase


class RestoreContract(CacheContract):
    @precondition(lambda self: self.generation < MAX_RESTARTS)
    @rule()
    def restart(self) -> None:
        """Daemon stop and start, with the lifecycle layer's restore in between."""
        self.hooks.shutting_down = True
        self.loop.run_until_complete(self.coordinator.aclose())
        self.loop.run_until_idle()
        self.hooks.shutting_down = False
        assert not self.running, "aclose left creators running"
        self.generation += 1
        self.coordinator = self._new_coordinator()

        async def restore() -> None:
            for object_id, row in list(self.hooks.rows.items()):
                if row.phase in ("in_flight", "cleaning"):
                    # Interrupted: the journal is run backwards and the name freed.
                    self.rolled_back[object_id] += 1
                    del self.hooks.rows[object_id]
                elif row.phase == "cached":
                    self.coordinator.restore_cached(row.name, object_id)
                    self.restored_cached_at[object_id] = self.now()
                    event("restart: cached object restored")
                else:
                    self.coordinator.restore_visible(row.name, object_id)

        self.loop.run_until_complete(restore())

    def _something_cached(self) -> bool:
        return any(
            (i := self.coordinator.lookup(n)) is not None and i.phase is Phase.CACHED for n in NAMES
        )

    @precondition(lambda self: self.generation < MAX_RESTARTS and self._something_cached())
    @rule()
    def restart_with_objects_in_the_cache(self) -> None:
        """The case restore exists for: it must keep them claimable, with a fresh expiry."""
        self.restart()

    @invariant()
    def restored_cached_objects_expire_grace_after_the_restart(self) -> None:
        for object_id, restored_at in self.restored_cached_at.items():
            self.expires_when_due(object_id, restored_at + GRACE)
