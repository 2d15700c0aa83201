"""The state-machine invariants of the cache of unclaimed objects (creation/cache.py): an
object handed to a client is never cleaned up, and one nobody claimed expires grace after
the last deadline of the requests that waited on it.
"""

from __future__ import annotations

from contract_machine import GRACE, ContractMachine
from hypothesis import event
from hypothesis.stateful import invariant

from cri_shim.creation.coordinator import Phase


class CacheContract(ContractMachine):
    @invariant()
    def a_handed_off_object_is_never_cached_expired_or_cleaned(self) -> None:
        self._handed_off_requests()
        for object_id in self.handed_off:
            assert object_id in self.hooks.published
            assert self.hooks.count("cached", object_id) == 0, f"{object_id} also cached"
            assert self.hooks.cleanup_started[object_id] == 0, f"{object_id} also cleaned"
            assert self.rolled_back[object_id] == 0, f"{object_id} rolled back at restart"

    @invariant()
    def claimed_objects_are_never_cleaned_up(self) -> None:
        assert not (self.hooks.published & set(self.hooks.cleanup_started))

    @invariant()
    def unclaimed_objects_expire_grace_after_the_last_deadline(self) -> None:
        for object_id, expires_at in self.hooks.cached_until.items():
            finished = self.hooks.first_time("cached", object_id)
            assert finished is not None
            waited = [
                r.deadline
                for r in self.requests
                if r.deadline is not None
                and (
                    r.reserved_id == object_id
                    or (
                        r.before is not None
                        and r.before.object_id == object_id
                        and r.before.phase is Phase.IN_FLIGHT
                    )
                )
            ]
            assert expires_at == max([finished, *waited]) + GRACE
            if object_id not in self.restored_cached_at:  # a restart starts a fresh expiry
                self.expires_when_due(object_id, expires_at)

    def expires_when_due(self, object_id: str, expires_at: float) -> None:
        """Cleaned up at `expires_at` exactly, unless claimed or rolled back first."""
        cleaned = self.hooks.first_time("cleanup", object_id)
        if cleaned is not None:
            event("cached object expired")
            assert cleaned == expires_at, f"{object_id} expired at {cleaned}, not {expires_at}"
        elif object_id not in self.hooks.published and object_id not in self.rolled_back:
            assert self.now() <= expires_at, f"{object_id} outlived its expiry"
