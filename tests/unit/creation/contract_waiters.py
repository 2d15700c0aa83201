"""The state-machine invariants of the requests waiting on a creation (creation/waiters.py
and inflight.py): every request returns by its own deadline, at the moment the contract
says, with an answer the contract allows for what the name was when it came; a duplicate
waiting when its creation finishes is handed the object (unless hand_off is off), every
later retry gets that same ID; with keep_on_timeout or hand_off off, no waiter gets an ID.
"""

from __future__ import annotations

from contract_machine import EPSILON, ContractMachine, Request
from creation_fakes import FakeCreationFailed
from hypothesis import event
from hypothesis.stateful import invariant

from cri_shim.creation.coordinator import NameInfo, Phase
from cri_shim.errors import DeadlineExceeded, NameReserved, Unavailable


class WaiterContract(ContractMachine):
    @invariant()
    def objects_become_visible_only_when_handed_to_a_client(self) -> None:
        """A finished object whose request has gone stays invisible until a retry claims it."""
        for object_id in self.hooks.published:
            published_at = self.hooks.first_time("publish", object_id)
            assert any(
                r.done
                and not r.task.cancelled()
                and r.task.exception() is None
                and r.task.result() == object_id
                and r.finished_at == published_at
                for r in self.requests
                if r.task is not None
            ), f"{object_id} was published at {published_at} but handed to nobody then"

    @invariant()
    def without_keep_on_timeout_a_creation_stops_when_its_request_gives_up(self) -> None:
        if self.keep_on_timeout:
            return
        for r in self.requests:
            if r.done and r.reserved_id is not None and r.generation == self.generation:
                gave_up = r.task is not None and (r.task.cancelled() or r.task.exception())
                if gave_up:
                    assert r.reserved_id not in self.running.values()

    @invariant()
    def only_a_hand_off_gives_a_waiting_duplicate_the_object(self) -> None:
        self._handed_off_requests()
        if not (self.keep_on_timeout and self.hand_off):
            assert self.handed_off == {}, "a waiting duplicate was given the object"

    @invariant()
    def a_handed_off_object_is_what_every_later_retry_gets(self) -> None:
        """The hand-off is safe only because a lost response is recovered: until the domain
        removes it, the object keeps the name, and each later request gets its ID."""
        self._handed_off_requests()
        for object_id, (handed, sent_before) in self.handed_off.items():
            removed = self.removed_after.get(object_id, len(self.requests))
            for r in self.requests[sent_before:removed]:
                if r.name != handed.name:
                    continue
                assert r.before is not None and r.before.phase is Phase.VISIBLE, (
                    f"{object_id} was handed off, yet a later request found {r.before}"
                )
                assert r.before.object_id == object_id
                if r.task is not None and r.task.done() and not r.task.cancelled():
                    assert r.task.exception() is None and r.task.result() == object_id

    @invariant()
    def requests_return_by_their_deadline(self) -> None:
        for r in self.requests:
            if r.deadline is None:
                continue
            if r.done:
                assert r.finished_at is not None and r.finished_at <= r.deadline + EPSILON
            else:
                assert self.now() < r.deadline, f"request for {r.name} outlived its deadline"

    @invariant()
    def answers_follow_the_contract(self) -> None:
        for r in self.requests:
            if r.done and not r.checked:
                r.checked = True
                self._check_answer(r)

    def _check_answer(self, r: Request) -> None:
        assert r.task is not None and r.finished_at is not None
        if r.task.cancelled():
            return  # the client went away; nobody reads the answer
        error = r.task.exception()
        result = None if error is not None else r.task.result()
        deadline = r.deadline if r.deadline is not None else float("inf")
        if isinstance(error, Unavailable):
            assert r.generation < self.generation, "UNAVAILABLE outside a restart"
            event("answer: unavailable (restart)")
            return
        if r.before is None:
            self._check_own_creation(r, result, error, deadline)
        elif r.before.phase in (Phase.VISIBLE, Phase.CACHED):
            # Rules 3 and 4: the object, at once.
            event(f"answer: {r.before.phase} object returned")
            assert result == r.before.object_id, f"expected {r.before.object_id}, got {error!r}"
            assert r.finished_at == r.started_at
            assert result in self.hooks.published
        else:
            self._check_duplicate(r, r.before, result, error, deadline)

    def _check_own_creation(
        self, r: Request, result: str | None, error: BaseException | None, deadline: float
    ) -> None:
        own = r.reserved_id
        assert own is not None
        released = self._event_time(("released",), own, r.started_at)
        if released is None:
            released = float("inf")
        event(f"answer to the creating request: {type(error).__name__ if error else 'id'}")
        if result is not None:
            assert result == own and own in self.hooks.published
            assert self.hooks.first_time("publish", own) == r.finished_at
            assert r.finished_at <= deadline
        elif isinstance(error, DeadlineExceeded):
            assert r.finished_at == deadline
        elif isinstance(error, FakeCreationFailed):
            assert own in str(error)
            # Told once the name is free again, or at its deadline if cleanup was slower.
            assert r.finished_at == min(deadline, released)
        else:
            raise AssertionError(f"unexpected answer to a new creation: {error!r}")

    def _check_duplicate(
        self,
        r: Request,
        before: NameInfo,
        result: str | None,
        error: BaseException | None,
        deadline: float,
    ) -> None:
        event(f"answer to a duplicate ({before.phase}): {type(error).__name__ if error else 'id'}")
        holder = before.object_id
        if not self.keep_on_timeout:
            assert result is None, "without keep_on_timeout a duplicate was handed the object"
            assert isinstance(error, NameReserved) and r.finished_at == r.started_at
            return
        released = self._event_time(("released",), holder, r.started_at)
        if before.phase is Phase.IN_FLIGHT:
            settled = self._event_time(("publish", "cached", "released"), holder, r.started_at)
        else:
            settled = released
        expected = min(deadline, settled if settled is not None else float("inf"))
        # When the creation it waited on finished (published or cached), if it did.
        finished = None
        if before.phase is Phase.IN_FLIGHT:
            finished = self._event_time(("publish", "cached"), holder, r.started_at)
        if result is not None:
            assert self.hand_off, "without hand_off a duplicate was handed the object"
            assert result == holder, f"handed {result}, not the {holder} it waited on"
            assert self.hooks.first_time("publish", holder) == finished == r.finished_at
            event("answer to a duplicate: handed the object")
        elif isinstance(error, NameReserved):
            assert holder in str(error) and "stage:" in str(error)
            if self.hand_off and finished is not None:
                # Finished while it waited: it must have been handed the object (and the
                # object not cached meanwhile); only a tie with its deadline may go either way.
                assert finished >= deadline, (
                    f"refused at {r.finished_at} although {holder} was finished at "
                    f"{finished}, before its deadline {deadline}"
                )
        elif isinstance(error, FakeCreationFailed):
            assert holder in str(error), "a duplicate was given another creation's error"
        else:
            raise AssertionError(f"unexpected answer to a duplicate: {error!r}")
        assert r.finished_at == expected, f"returned at {r.finished_at}, expected {expected}"
