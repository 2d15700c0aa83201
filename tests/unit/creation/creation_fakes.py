"""Test doubles for the creation core: a virtual-time event loop, fake hooks, fake creators.

The virtual-time loop is a stock selector event loop whose clock only moves when there is
nothing left to run at the current instant: it then jumps to the next timer. Deadlines of
minutes, claim graces and cleanup budgets cost no real time, and every run is
deterministic, which is what lets the state-machine test explore thousands of schedules.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from cri_shim.creation.coordinator import Stage
from cri_shim.errors import Internal

# ---- virtual time ------------------------------------------------------------------------


class _VirtualSelector(selectors.BaseSelector):
    """Delegates file descriptors to a real selector, but never blocks: it moves the clock."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.now = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing scheduled and nothing ready (deadlock)")
        self.now += timeout  # the loop asked to sleep until its next timer: jump there
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() is virtual, starting at 0."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now

    def run_until_idle(self) -> None:
        """Run everything due at the current instant, without moving the clock.

        Reads the loop's private queues, which is fine for a test double: it is what lets a
        test look at the system at a well-defined point instead of racing its timers.
        """
        while True:
            self.run_until_complete(asyncio.sleep(0))
            ready: Any = self._ready  # type: ignore[attr-defined]
            scheduled: Any = self._scheduled  # type: ignore[attr-defined]
            due = any(not h.cancelled() and h.when() <= self.time() for h in scheduled)
            if not ready and not due:
                return


def run_in_virtual_time(main: Coroutine[Any, Any, Any]) -> Any:
    """Run `main` to completion on a fresh virtual-time loop, then close it tidily."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        leftovers = asyncio.all_tasks(loop)
        for task in leftovers:
            task.cancel()
        if leftovers:
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def in_virtual_time(
    test: Callable[..., Coroutine[Any, Any, None]],
) -> Callable[..., None]:
    """Make an `async def` test run on a virtual-time loop (a plain test to pytest)."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        run_in_virtual_time(test(*args, **kwargs))

    return wrapper


def now() -> float:
    return asyncio.get_running_loop().time()


async def advance_to(when: float) -> None:
    """Let virtual time run until `when` (everything due by then has run)."""
    await asyncio.sleep(max(0.0, when - now()))


# ---- fake hooks: a database in a dict ---------------------------------------------------


@dataclass
class FakeRow:
    """What the lifecycle layer would keep in the database for one object."""

    name: str
    phase: str  # in_flight, cached, visible, cleaning
    stage: str = "reserved"
    expires_at: float | None = None


@dataclass
class CleanupPlan:
    """How FakeHooks.cleanup behaves for one object."""

    seconds: float = 0.0
    error: Exception | None = None
    hangs: bool = False  # never finishes: only the coordinator's budget ends it


@dataclass
class FakeHooks:
    """CreationHooks over an in-memory 'database', recording every call with its time.

    Protocol violations (publishing a cleaned object, releasing before cleanup ended,
    reserving a name the database already holds) are collected in `violations` rather than
    raised, since a raise inside a hook would be absorbed by the coordinator's own error
    handling and hide the bug.
    """

    rows: dict[str, FakeRow] = field(default_factory=dict)
    calls: list[tuple[str, str, float]] = field(default_factory=list)  # hook, object_id, time
    released_names: list[tuple[str, str]] = field(default_factory=list)
    published: set[str] = field(default_factory=set)
    cached_until: dict[str, float] = field(default_factory=dict)  # expires_at given to cached()
    cleanup_started: Counter[str] = field(default_factory=Counter)
    cleanup_ended: Counter[str] = field(default_factory=Counter)  # returned, raised, timed out
    cleanup_interrupted: Counter[str] = field(default_factory=Counter)  # by shutdown
    cleanup_plans: dict[str, CleanupPlan] = field(default_factory=dict)
    default_cleanup: CleanupPlan = field(default_factory=CleanupPlan)
    fail_publish: Exception | None = None
    fail_released: Exception | None = None
    fail_reserve: Exception | None = None
    shutting_down: bool = False
    violations: list[str] = field(default_factory=list)

    def _record(self, hook: str, object_id: str) -> None:
        self.calls.append((hook, object_id, now()))

    def count(self, hook: str, object_id: str | None = None) -> int:
        return sum(1 for h, i, _ in self.calls if h == hook and object_id in (None, i))

    def first_time(self, hook: str, object_id: str, after: float = float("-inf")) -> float | None:
        times = [t for h, i, t in self.calls if h == hook and i == object_id and t >= after]
        return min(times, default=None)

    def names_held(self) -> dict[str, str]:
        return {row.name: object_id for object_id, row in self.rows.items()}

    # -- CreationHooks --

    def reserve(self, name: str, object_id: str) -> None:
        if self.fail_reserve is not None:
            raise self.fail_reserve
        self._record("reserve", object_id)
        if name in self.names_held():
            self.violations.append(f"{name} reserved for {object_id} while the database holds it")
        self.rows[object_id] = FakeRow(name=name, phase="in_flight")

    def stage_changed(self, object_id: str, stage: str) -> None:
        self._record("stage_changed", object_id)
        row = self.rows.get(object_id)
        if row is None or row.phase != "in_flight":
            self.violations.append(f"stage {stage!r} for {object_id}, which is not in flight")
            return
        row.stage = stage

    def cached(self, object_id: str, expires_at: float) -> None:
        self._record("cached", object_id)
        row = self.rows.get(object_id)
        if row is None or row.phase != "in_flight":
            self.violations.append(f"caching {object_id}, which is not in flight")
            return
        row.phase = "cached"
        row.expires_at = expires_at
        self.cached_until[object_id] = expires_at

    def publish(self, object_id: str) -> None:
        if self.fail_publish is not None:
            raise self.fail_publish
        self._record("publish", object_id)
        row = self.rows.get(object_id)
        if self.cleanup_started[object_id] or row is None:
            self.violations.append(f"publishing {object_id}, which is cleaned or gone")
            return
        row.phase = "visible"
        row.expires_at = None
        self.published.add(object_id)

    async def cleanup(self, object_id: str) -> None:
        self._record("cleanup", object_id)
        self.cleanup_started[object_id] += 1
        if object_id in self.published:
            self.violations.append(f"cleaning up {object_id}, which a client was given")
        row = self.rows.get(object_id)
        if row is not None:
            # Like the real journal, mark the row first: a restart must roll it back, not
            # restore a half-cleaned object as cached.
            row.phase = "cleaning"
        plan = self.cleanup_plans.get(object_id, self.default_cleanup)
        try:
            if plan.hangs:
                await asyncio.Event().wait()
            if plan.seconds:
                await asyncio.sleep(plan.seconds)
        except asyncio.CancelledError:
            if self.shutting_down:
                self.cleanup_interrupted[object_id] += 1
            else:
                self.cleanup_ended[object_id] += 1  # the coordinator's budget ran out
            raise
        self.cleanup_ended[object_id] += 1
        if plan.error is not None:
            raise plan.error.with_traceback(None)  # plans are shared between test cases

    def released(self, name: str, object_id: str) -> None:
        self._record("released", object_id)
        if not self.cleanup_ended[object_id]:
            self.violations.append(f"{name} released for {object_id} before its cleanup ended")
        row = self.rows.pop(object_id, None)
        if row is None or row.name != name:
            self.violations.append(f"{name} released for {object_id}, which does not hold it")
        self.released_names.append((name, object_id))
        if self.fail_released is not None:
            raise self.fail_released


# ---- fake creators -----------------------------------------------------------------------


class FakeCreationFailed(Internal):
    """What a FakeCreator raises when told to fail."""


@dataclass
class FakeCreator:
    """A creator whose steps take virtual time: each (stage, seconds) in turn, then maybe fail."""

    steps: list[tuple[str, float]] = field(default_factory=lambda: [("sandbox network", 1.0)])
    error: Exception | None = None
    calls: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def __call__(self, object_id: str, stage: Stage) -> None:
        self.calls.append(object_id)
        try:
            for name, seconds in self.steps:
                stage.set(name)
                await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled.append(object_id)
            raise
        if self.error is not None:
            raise self.error
        self.finished.append(object_id)
