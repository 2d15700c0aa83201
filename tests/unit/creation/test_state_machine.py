"""The creation contract as a state machine, explored by hypothesis in virtual time.

Hypothesis sends kubelet-like requests (two names, so that they collide a lot) with
creators that are quick or slow, succeed or fail, and cleanups that finish, fail or hang;
it lets time pass, cancels requests (client gone), removes visible objects and restarts the
daemon. After every step it checks the invariants of DESIGN §2:

- at most one creation per name at a time, and the database agrees with memory;
- an object handed to a client is never cleaned up;
- every object nobody claimed is cleaned up exactly once, and its name released after;
- every request returns by its own deadline, at the moment the contract says;
- every answer is one the contract allows for what the name was when the request came;
- a duplicate waiting when its creation finishes is handed the object (unless hand_off is
  off), every later retry gets that same ID, and a handed-off object is never cached,
  expired or cleaned up; with keep_on_timeout or hand_off off, no waiter gets an ID.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from creation_fakes import CleanupPlan, FakeCreationFailed, FakeHooks, VirtualTimeLoop
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cri_shim.creation.coordinator import CreationCoordinator, NameInfo, Phase, Stage
from cri_shim.errors import DeadlineExceeded, NameReserved, Unavailable

NAMES = ("k8s_POD_a_ns_uid-a_0", "k8s_POD_b_ns_uid-b_0")
GRACE = 20.0
CLEANUP_TIMEOUT = 5.0
EPSILON = 1e-9
MAX_RESTARTS = 2  # per run: each one ends every window in which a retry could claim
SETTLE = 1000.0  # longer than any creator, cleanup, grace and deadline put together
STAGES = ("sandbox storage", "sandbox namespaces", "sandbox network")

# Binary fractions only: virtual times then add up exactly and can be compared with ==.
durations = st.sampled_from([0.0, 0.5, 2.0, 5.0, 12.0])
deadlines = st.sampled_from([0.0, 1.0, 3.0, 8.0, 30.0, None])  # relative to now
cleanups = st.sampled_from(
    [
        CleanupPlan(),
        CleanupPlan(seconds=2.0),
        CleanupPlan(error=OSError("umount: target is busy")),
        CleanupPlan(hangs=True),  # cut off by CLEANUP_TIMEOUT
    ]
)
phase_in_database = {
    Phase.IN_FLIGHT: "in_flight",
    Phase.CACHED: "cached",
    Phase.VISIBLE: "visible",
    Phase.CLEANING: "cleaning",
}


@dataclass(frozen=True)
class Script:
    """What the fake creator of one request does, should that request start a creation."""

    steps: tuple[tuple[str, float], ...]
    fails: bool
    cleanup: CleanupPlan


scripts = st.builds(
    Script,
    steps=st.lists(st.tuples(st.sampled_from(STAGES), durations), min_size=1, max_size=2).map(
        tuple
    ),
    fails=st.booleans(),
    cleanup=cleanups,
)


@dataclass
class Request:
    name: str
    started_at: float
    deadline: float | None
    before: NameInfo | None  # what the coordinator knew of the name when the request came
    generation: int  # which daemon (restarts) it was sent to
    reserved_id: str | None = None  # the ID it reserved, if the name was free
    task: asyncio.Task[str] | None = None
    finished_at: float | None = None
    checked: bool = False

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()


class CreationContract(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualTimeLoop()
        self.hooks = FakeHooks()
        self.ids = itertools.count(1)
        self.requests: list[Request] = []
        self.running: dict[str, str] = {}  # name -> object ID whose creator is running
        self.creator_calls: Counter[str] = Counter()
        self.rolled_back: Counter[str] = Counter()  # by the lifecycle layer at restart
        self.removed: set[str] = set()  # visible objects the domain removed
        self.restored_cached_at: dict[str, float] = {}
        self.violations: list[str] = []
        self.generation = 0
        self.last_name = NAMES[0]
        self.keep_on_timeout = True
        self.hand_off = True
        # Objects a waiting duplicate was handed: the request, and how many requests had
        # been sent when its answer was seen (every one sent since came after the hand-off).
        self.handed_off: dict[str, tuple[Request, int]] = {}
        self.removed_after: dict[str, int] = {}  # object ID -> requests sent before removal
        self.coordinator: CreationCoordinator

    # ---- plumbing ------------------------------------------------------------------------

    def now(self) -> float:
        return self.loop.time()

    def _new_coordinator(self) -> CreationCoordinator:
        return CreationCoordinator(
            "sandbox",
            self.hooks,
            claim_grace=GRACE,
            keep_on_timeout=self.keep_on_timeout,
            hand_off=self.hand_off,
            cleanup_timeout=CLEANUP_TIMEOUT,
            new_id=lambda: f"id{next(self.ids)}",
        )

    def _creator(self, name: str, script: Script) -> Any:
        async def fake_creator(object_id: str, stage: Stage) -> None:
            if name in self.running:
                self.violations.append(
                    f"{name}: {object_id} started while {self.running[name]} ran"
                )
            self.running[name] = object_id
            self.creator_calls[object_id] += 1
            self.hooks.cleanup_plans[object_id] = script.cleanup
            try:
                for step, seconds in script.steps:
                    stage.set(step)
                    await asyncio.sleep(seconds)
                if script.fails:
                    raise FakeCreationFailed(f"creation of {object_id} failed")
            finally:
                if self.running.get(name) == object_id:
                    del self.running[name]

        return fake_creator

    def _event_time(self, hooks: tuple[str, ...], object_id: str, after: float) -> float | None:
        times = [self.hooks.first_time(h, object_id, after) for h in hooks]
        return min((t for t in times if t is not None), default=None)

    # ---- rules -----------------------------------------------------------------------------

    @initialize(keep_on_timeout=st.booleans(), hand_off=st.booleans())
    def start(self, keep_on_timeout: bool, hand_off: bool) -> None:
        self.keep_on_timeout = keep_on_timeout
        self.hand_off = hand_off
        self.coordinator = self._new_coordinator()

    def _send(self, name: str, deadline: float | None, script: Script) -> Request:
        absolute = None if deadline is None else self.now() + deadline
        request = Request(
            name, self.now(), absolute, self.coordinator.lookup(name), self.generation
        )

        async def send() -> str:
            try:
                return await self.coordinator.create(name, absolute, self._creator(name, script))
            finally:
                request.finished_at = self.now()

        self.last_name = name
        request.task = self.loop.create_task(send())
        self.requests.append(request)
        return request

    def _sent(self, burst: list[Request]) -> None:
        """Run a burst of requests sent in one instant; work out whom each one met."""
        reserves_before = self.hooks.count("reserve")
        self.loop.run_until_idle()
        new = [i for h, i, _ in self.hooks.calls if h == "reserve"][reserves_before:]
        if burst[0].before is None:
            # The first reserves the name in its first step, before anything slow, so that
            # the others, sent in the same instant, already find it in flight.
            assert len(new) == 1, f"{len(new)} reservations for one name in one instant"
            assert self.hooks.first_time("reserve", new[0]) == burst[0].started_at
            burst[0].reserved_id = new[0]
            for other in burst[1:]:
                other.before = NameInfo(other.name, new[0], Phase.IN_FLIGHT, "reserved", None)
        else:
            assert new == [], "a held name was reserved again"

    @rule(name=st.sampled_from(NAMES), deadline=deadlines, script=scripts)
    def request(self, name: str, deadline: float | None, script: Script) -> None:
        self._sent([self._send(name, deadline, script)])

    @rule(
        name=st.sampled_from(NAMES),
        deadlines=st.lists(deadlines, min_size=2, max_size=5),
        script=scripts,
    )
    def burst(self, name: str, deadlines: list[float | None], script: Script) -> None:
        """Identical requests in one instant (kubelet's retry racing crictl, say)."""
        self._sent([self._send(name, d, script) for d in deadlines])

    @rule(deadline=deadlines, script=scripts)
    def retry(self, deadline: float | None, script: Script) -> None:
        """kubelet's way: the same name again, after a timeout or `name is reserved`."""
        self.request(self.last_name, deadline, script)

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 6.0, 15.0, SETTLE]))
    def let_time_pass(self, dt: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(dt))
        self.loop.run_until_idle()
        if dt == SETTLE:
            self._check_everything_settled()

    @rule(pick=st.integers(0, 50))
    def client_goes_away(self, pick: int) -> None:
        pending = [r for r in self.requests if not r.done]
        if pending:
            task = pending[pick % len(pending)].task
            assert task is not None
            task.cancel()
            self.loop.run_until_idle()

    @rule(name=st.sampled_from(NAMES))
    def remove_visible(self, name: str) -> None:
        """RemovePodSandbox: the domain undoes the object itself, then frees the name."""
        info = self.coordinator.lookup(name)
        if info is None or info.phase is not Phase.VISIBLE:
            return
        self.hooks.rows.pop(info.object_id)
        self.removed.add(info.object_id)
        self.removed_after[info.object_id] = len(self.requests)
        self.coordinator.release(name, object_id=info.object_id)

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

    def _check_everything_settled(self) -> None:
        """After SETTLE seconds nothing is pending, and only visible objects hold names."""
        assert all(r.done for r in self.requests), "a request is still waiting"
        for name in NAMES:
            info = self.coordinator.lookup(name)
            assert info is None or info.phase is Phase.VISIBLE, f"{name} is stuck: {info}"
        for object_id in self._reserved_ids():
            if object_id not in self.hooks.published:
                assert self._cleanups(object_id) == 1, f"{object_id} was never cleaned up"

    # ---- invariants ----------------------------------------------------------------------

    def _reserved_ids(self) -> list[str]:
        return [i for h, i, _ in self.hooks.calls if h == "reserve"]

    def _cleanups(self, object_id: str) -> int:
        return self.hooks.cleanup_ended[object_id] + self.rolled_back[object_id]

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

    def _handed_off_requests(self) -> None:
        """Note every duplicate of a creation in flight that came back with an ID."""
        for r in self.requests:
            if (
                r.done
                and r.reserved_id is None
                and r.before is not None
                and r.before.phase is Phase.IN_FLIGHT
                and r.task is not None
                and not r.task.cancelled()
                and r.task.exception() is None
            ):
                self.handed_off.setdefault(r.task.result(), (r, len(self.requests)))

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
    def unclaimed_objects_are_cleaned_up_at_most_once_and_then_released(self) -> None:
        for object_id in self._reserved_ids():
            assert self.hooks.cleanup_started[object_id] <= 1
            assert self._cleanups(object_id) <= 1
            if self._cleanups(object_id):
                # Released after cleanup: nothing holds the name for this object any more.
                assert object_id not in self.hooks.rows
                held = [self.coordinator.lookup(n) for n in NAMES]
                assert object_id not in {i.object_id for i in held if i is not None}

    @invariant()
    def a_freed_name_was_cleaned_up_or_handed_out(self) -> None:
        held = {i.object_id for n in NAMES if (i := self.coordinator.lookup(n)) is not None}
        for object_id in self._reserved_ids():
            if object_id not in held and object_id not in self.hooks.published:
                assert self._cleanups(object_id) == 1, f"{object_id} let go without cleanup"

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
            if object_id in self.restored_cached_at:
                expires_at = self.restored_cached_at[object_id] + GRACE
            cleaned = self.hooks.first_time("cleanup", object_id)
            if cleaned is not None:
                event("cached object expired")
                assert cleaned == expires_at, f"{object_id} expired at {cleaned}, not {expires_at}"
            elif object_id not in self.hooks.published and object_id not in self.rolled_back:
                assert self.now() <= expires_at, f"{object_id} outlived its expiry"

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

    def teardown(self) -> None:
        self.hooks.shutting_down = True
        try:
            self.loop.run_until_complete(self.coordinator.aclose())
            for r in self.requests:
                if r.task is not None and not r.task.done():
                    r.task.cancel()
            self.loop.run_until_idle()
            for r in self.requests:
                if r.task is not None and not r.task.cancelled():
                    r.task.exception()  # read, so asyncio does not report it as lost
        finally:
            self.loop.close()


CreationContract.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCreationContract = CreationContract.TestCase
