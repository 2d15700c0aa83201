"""The state-machine invariants of the held names (creation/reservation.py): at most one
creation per name at a time, memory and database agree, and a name is let go only once its
object was cleaned up or handed out.
"""

from __future__ import annotations

from contract_machine import NAMES, ContractMachine, phase_in_database
from hypothesis.stateful import invariant

from cri_shim.creation.coordinator import Phase


class ReservationContract(ContractMachine):
    @invariant()
    def fakes_saw_no_protocol_violation(self) -> None:
        assert self.hooks.violations == []
        assert self.violations == []

    @invariant()
    def one_creation_per_object(self) -> None:
        assert all(n == 1 for n in self.creator_calls.values())

    @invariant()
    def memory_and_database_agree(self) -> None:
        for name in NAMES:
            info = self.coordinator.lookup(name)
            rows = {i: r for i, r in self.hooks.rows.items() if r.name == name}
            if info is None:
                assert rows == {}, f"{name}: the database holds {rows}, memory nothing"
            else:
                assert list(rows) == [info.object_id], f"{name}: {rows} vs {info}"
                assert rows[info.object_id].phase == phase_in_database[info.phase]
                if info.phase is Phase.IN_FLIGHT:
                    assert rows[info.object_id].stage == info.stage

    @invariant()
    def a_freed_name_was_cleaned_up_or_handed_out(self) -> None:
        held = {i.object_id for n in NAMES if (i := self.coordinator.lookup(n)) is not None}
        for object_id in self._reserved_ids():
            if object_id not in held and object_id not in self.hooks.published:
                assert self._cleanups(object_id) == 1, f"{object_id} let go without cleanup"

    @invariant()
    def unclaimed_objects_are_cleaned_up_at_most_once_and_then_released(self) -> None:
        for object_id in self._reserved_ids():
            assert self.hooks.cleanup_started[object_id] <= 1
            assert self._cleanups(object_id) <= 1
            if self._cleanups(object_id):
                # Released after cleanup: nothing holds the name for this object any more.
                assert object_id not in self.hooks.rows
                held = [self.coordinator.lookup(n) for n in NAMES]
                assert object_id not in {i.object_id for i in held if i is not None}
