"""The creation contract as a state machine: the requests, time, cancellations, removals
and restarts hypothesis drives the coordinator with, and what is recorded of them.

Hypothesis sends kubelet-like requests (two names, so that they collide a lot) with
creators that are quick or slow, succeed or fail, and cleanups that finish, fail or hang;
it lets time pass, cancels requests (client gone), removes visible objects and restarts the
daemon. The invariants live beside the part of the coordinator they hold for
(contract_reservation.py, contract_waiters.py, contract_cache.py, contract_restore.py);
test_state_machine.py runs them all together.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from creation_fakes import CleanupPlan, FakeCreationFailed, FakeHooks, VirtualTimeLoop
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from cri_shim.creation.coordinator import CreationCoordinator, NameInfo, Phase, Stage

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


class ContractMachine(RuleBasedStateMachine):
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

    def _reserved_ids(self) -> list[str]:
        return [i for h, i, _ in self.hooks.calls if h == "reserve"]

    def _cleanups(self, object_id: str) -> int:
        return self.hooks.cleanup_ended[object_id] + self.rolled_back[object_id]

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

    def _check_everything_settled(self) -> None:
        """After SETTLE seconds nothing is pending, and only visible objects hold names."""
        assert all(r.done for r in self.requests), "a request is still waiting"
        for name in NAMES:
            info = self.coordinator.lookup(name)
            assert info is None or info.phase is Phase.VISIBLE, f"{name} is stuck: {info}"
        for object_id in self._reserved_ids():
            if object_id not in self.hooks.published:
                assert self._cleanups(object_id) == 1, f"{object_id} was never cleaned up"

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
