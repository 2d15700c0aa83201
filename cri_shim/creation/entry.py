"""The coordinator's vocabulary: a held name's phases and stages, what the domain layer
persists for it (`CreationHooks`), and the record of one held name (`Entry`) that every
part of the coordinator reads and changes.

A name is in one of four phases:

    (free) --create--> IN_FLIGHT --done, someone waiting--> VISIBLE --release()--> (free)
                           |  \\--done, nobody waiting-----> CACHED --claim--> VISIBLE
                           |                                    \\--expiry--> CLEANING
                           \\--failed / abandoned-----------------------------> CLEANING
                                                          CLEANING --cleanup--> (free)
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from cri_shim import tracing
from cri_shim.errors import DeadlineExceeded

# The stage a name is at before its creator reports one, and while it is being undone.
STAGE_RESERVED = "reserved"
STAGE_CLEANUP = "cleanup"
STAGE_REMOVAL = "removal"


class CreationHooks(Protocol):
    """What the domain layer persists and undoes for the coordinator.

    Every hook but `cleanup` is synchronous, so that the memory change and the database
    write happen in one step with no other request in between.

    A hook that raises fails its step: `reserve` fails the request and leaves the name
    free; `stage_changed` (raised inside the creator), `publish` and `cached` fail the
    creation, which is then undone (a failed `publish` on a claim leaves the object cached);
    `cleanup` is logged and the name released anyway; `released` is logged, and the name is
    free in memory all the same.
    """

    def reserve(self, name: str, object_id: str) -> None:
        """Persist that `name` is reserved for `object_id` (before any work starts)."""

    def stage_changed(self, object_id: str, stage: str) -> None:
        """Persist the stage the creation has reached."""

    def cached(self, object_id: str, expires_at: float) -> None:
        """Persist that the object is finished but unclaimed, until `expires_at`."""

    def publish(self, object_id: str) -> None:
        """Make the object visible: listed and operable."""

    async def cleanup(self, object_id: str) -> None:
        """Undo everything the creation did (the undo journal). May raise."""

    def released(self, name: str, object_id: str) -> None:
        """Persist that `name` is free again."""


class Phase(enum.StrEnum):
    IN_FLIGHT = "in_flight"  # the creator is running
    CACHED = "cached"  # finished, unclaimed, invisible; waiting for a retry or expiry
    VISIBLE = "visible"  # handed to a client: listed and operable
    CLEANING = "cleaning"  # failed, abandoned or expired: being undone, name still held


class Stage:
    """The creator's handle for reporting how far it has got.

    The stage is what a duplicate request is told (`name is reserved ... (stage: ...)`),
    what Status verbose lists for stalled creations, and what the database records.
    """

    def __init__(self, report: Callable[[str], None], current: str = STAGE_RESERVED) -> None:
        self._report = report
        self._current = current

    @property
    def current(self) -> str:
        return self._current

    def set(self, stage: str) -> None:
        self._current = stage
        self._report(stage)


Creator = Callable[[str, Stage], Awaitable[None]]


@dataclass(frozen=True)
class NameInfo:
    """What the coordinator knows about one name (see `lookup`)."""

    name: str
    object_id: str
    phase: Phase
    stage: str
    expires_at: float | None


class CreatorScope:
    """The creator's cancellation by an abandonment, told apart from the daemon's shutdown.

    Made in the task that runs the creator; `cancel` (from a request's task) cancels that
    task once. Where the CancelledError is caught, `withdraw` takes the request back, as
    asyncio.timeout does with its own, so that the task's later timeouts and cancellations
    work as if there had been none; it says whether this was the only cancellation (False:
    the task is being cancelled by someone else too, and must end).
    """

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self.cancelled = False
        self._withdrawn = False

    def cancel(self) -> None:
        if not self.cancelled and self._task is not None:
            self.cancelled = True
            self._task.cancel()

    def withdraw(self) -> bool:
        if not self.cancelled or self._task is None:
            return False
        if self._withdrawn:
            return self._task.cancelling() == 0
        self._withdrawn = True
        return self._task.uncancel() == 0


@dataclass(eq=False)
class Entry:
    """One held name and what is happening to it."""

    name: str
    object_id: str
    phase: Phase
    stage: str
    reserved_at: float
    stage_since: float
    # Set when the current creation (or expiry cleanup) settles; what requests wait on.
    settled: asyncio.Event | None = None
    # The error of a failed creation, handed to every request waiting on it.
    error: BaseException | None = None
    requester_waiting: bool = False
    watchers: int = 0
    # The latest time any request waiting on this creation gives up (see `expiry_time`).
    latest_deadline: float | None = None
    expires_at: float | None = None
    # keep_on_timeout is off and the request gave up: the creation is rolled back.
    abandoned: bool = False
    creator_scope: CreatorScope | None = None  # while the creator runs
    claimed: asyncio.Event | None = None  # while the object waits in the cache
    # The creation's trace (its root span open until the object is visible or released).
    trace: tracing.CreationTrace = tracing.NO_CREATION_TRACE

    def note_deadline(self, when: float) -> None:
        if self.latest_deadline is None or when > self.latest_deadline:
            self.latest_deadline = when

    def enter(self, phase: Phase, stage: str, now: float) -> None:
        """Move to `phase` at `stage`, whose clock starts `now`."""
        self.phase = phase
        self.stage = stage
        self.stage_since = now

    def settle(self) -> None:
        """Wake whoever waits on the current creation or cleanup."""
        if self.settled is not None:
            self.settled.set()
            if self.phase is Phase.VISIBLE:
                self.drop_events()

    def drop_events(self) -> None:
        """A visible object's events, once set, have woken every waiter (each holds its own
        reference) and no request waits on a visible name again: kept, they are ~1 KiB an
        object (an asyncio event and its deque) for as long as the object lives."""
        self.settled = None
        self.claimed = None

    def error_to_raise(self) -> BaseException:
        assert self.error is not None
        # One error object goes to every request that waited on the creation: reset its
        # traceback, so that each raise shows its own rather than all of them piled up.
        return self.error.with_traceback(None)


def abandoned_error(kind: str, entry: Entry) -> DeadlineExceeded:
    """What the requests of a creation abandoned with its request are told."""
    return DeadlineExceeded(
        f"deadline exceeded: {kind} creation of {entry.name!r} was abandoned at "
        f"stage {entry.stage!r} because its request gave up (keep_on_timeout is off)"
    )
