"""Idempotent creation under client deadlines: the contract of DESIGN §2, and nothing else.

The coordinator owns the life of a *name*, from its reservation to its release: one
coroutine per name runs the creation (detached from the request that started it), publishes
or caches what it made, waits for a claim or the expiry, and cleans up. These coroutines
belong to the coordinator's task group, which `aclose()` (daemon shutdown) cancels. It does
no I/O of its own: the domain layer does the work in the creator it passes to `create()` and
persists every decision through `CreationHooks`, in the same step as the memory change; what
happens is counted by a `CreationObserver` (statistics.py).

A name is in one of four phases:

    (free) --create--> IN_FLIGHT --done, someone waiting--> VISIBLE --release()--> (free)
                           |  \\--done, nobody waiting-----> CACHED --claim--> VISIBLE
                           |                                    \\--expiry--> CLEANING
                           \\--failed / abandoned-----------------------------> CLEANING
                                                          CLEANING --cleanup--> (free)

Every method must be called from the event loop's thread. Deadlines are absolute times on
the coordinator's clock, which is the event loop's clock (`loop.time()`) unless one is
injected. Waits are turned into delays on that clock and slept on the loop, so an injected
clock must run at the loop's pace; tests that want virtual time run a virtual-time loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

import anyio
import anyio.abc

from cri_shim import logcontext, tracing
from cri_shim.creation.registrar import NameRegistrar
from cri_shim.creation.statistics import (
    CreationObserver,
    CreationStatistics,
    CreationStats,
    InFlightInfo,
)
from cri_shim.errors import DeadlineExceeded, FailedPrecondition, NameReserved, Unavailable

log = logging.getLogger("cri_shim.creation")

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


@dataclass(eq=False)
class _Entry:
    """One held name and what is happening to it."""

    name: str
    object_id: str
    phase: Phase
    stage: str
    reserved_at: float
    stage_since: float
    # Set when the current creation (or expiry cleanup) settles; what requests wait on.
    settled: anyio.Event | None = None
    # The error of a failed creation, handed to every request waiting on it.
    error: BaseException | None = None
    requester_waiting: bool = False
    watchers: int = 0
    # The latest time any request waiting on this creation gives up (see `_expiry_time`).
    latest_deadline: float | None = None
    expires_at: float | None = None
    # keep_on_timeout is off and the request gave up: the creation is rolled back.
    abandoned: bool = False
    creator_scope: anyio.CancelScope | None = None  # while the creator runs
    claimed: anyio.Event | None = None  # while the object waits in the cache
    # The creation's trace (its root span open until the object is visible or released).
    trace: tracing.CreationTrace = tracing.NO_CREATION_TRACE

    def note_deadline(self, when: float) -> None:
        if self.latest_deadline is None or when > self.latest_deadline:
            self.latest_deadline = when


class CreationCoordinator:
    """Reserves names, runs creations detached from their requests, caches and expires.

    `kind` ("sandbox", "container") only appears in messages and logs.

    `keep_on_timeout=False` is the containerd-like comparison mode: a creation whose request
    gives up is cancelled and rolled back, and duplicates are refused at once.

    `hand_off=False` is the CRI-O-like comparison mode: a duplicate that waits on a creation
    is refused with `name is reserved` even when the creation finishes while it waits, and
    only its next retry gets the object (from the cache).

    `hooks` persists and undoes (the domain layer implements CreationHooks); `observer` is
    told of every event and stage change, and its figures are what stats() reports
    (CreationStatistics unless another is given); `tracer` gives each creation a trace of
    its own, which the requests that ask for it link to.
    """

    def __init__(
        self,
        kind: str,
        hooks: CreationHooks,
        *,
        claim_grace: float = 120.0,
        keep_on_timeout: bool = True,
        hand_off: bool = True,
        cleanup_timeout: float = 120.0,
        clock: Callable[[], float] | None = None,
        new_id: Callable[[], str] | None = None,
        observer: CreationObserver | None = None,
        tracer: tracing.Tracer = tracing.NO_TRACER,
    ) -> None:
        self._kind = kind
        self._hooks = hooks
        self._claim_grace = claim_grace
        self._keep_on_timeout = keep_on_timeout
        self._hand_off = hand_off
        self._cleanup_timeout = cleanup_timeout
        self._clock = clock if clock is not None else _loop_time
        self._new_id = new_id if new_id is not None else _random_id
        self._registrar = NameRegistrar()
        self._observer = observer if observer is not None else CreationStatistics()
        self._tracer = tracer
        self._entries: dict[str, _Entry] = {}
        # The task group of the names' coroutines, and the task that holds it open.
        self._group: anyio.abc.TaskGroup | None = None
        self._group_host: asyncio.Task[None] | None = None
        self._not_started: list[tuple[_Entry, Creator | None, contextvars.Context]] = []
        self._closing = False

    # ---- the request path ----------------------------------------------------------

    async def create(self, name: str, deadline: float | None, run: Creator) -> str:
        """Create the object called `name` with `run(object_id, stage)`, or get it back.

        Returns the object's ID once it is visible. `deadline` is absolute on the
        coordinator's clock; None means the request waits as long as the creation takes.
        Raises DeadlineExceeded when the deadline passes first (the creation goes on and the
        next request with this name gets the object), NameReserved to a duplicate of a
        creation that is still in flight at its deadline, and the creator's own error when
        the creation failed. A duplicate that is waiting when the creation finishes gets the
        object's ID (unless `hand_off` is off).
        """
        if self._closing:
            raise Unavailable(f"cri-shim is shutting down; retry {name!r} once it is back")
        entry = self._entries.get(name)
        if entry is None:
            entry = self._reserve(name, run)
            return await self._await_own_creation(entry, deadline)
        # The rest of the request is about this object, its log lines included.
        logcontext.bind_object(self._kind, entry.object_id, entry.name)
        if entry.phase is Phase.VISIBLE:
            # The same request again: its response was lost or it raced its own retry.
            # Answering with the object (as CRI-O does) is what keeps a claimed object from
            # ever leaking: the client can always get the ID it was owed.
            self._count("returned_existing", entry, "already visible, returning it")
            return entry.object_id
        if entry.phase is Phase.CACHED:
            return self._claim_cached(entry)
        return await self._watch(entry, deadline)

    def _reserve(self, name: str, run: Creator) -> _Entry:
        # Synchronous up to the spawn: no other request can see the name free in between.
        object_id = self._new_id()
        self._registrar.reserve(name, object_id)
        try:
            self._hooks.reserve(name, object_id)
        except BaseException:
            self._registrar.release(name)
            raise
        now = self._clock()
        entry = _Entry(
            name=name,
            object_id=object_id,
            phase=Phase.IN_FLIGHT,
            stage=STAGE_RESERVED,
            reserved_at=now,
            stage_since=now,
            settled=anyio.Event(),
            requester_waiting=True,
        )
        self._entries[name] = entry
        entry.trace = self._tracer.creation(self._kind, name, object_id)
        logcontext.bind_object(self._kind, object_id, name)
        self._count("reserved", entry, "reserved, creation started")
        self._start(entry, run)
        return entry

    async def _await_own_creation(self, entry: _Entry, deadline: float | None) -> str:
        """The requester that reserved the name waits for its creation, until its deadline."""
        if deadline is not None:
            entry.note_deadline(deadline)
        try:
            settled = await self._wait(entry.settled, deadline)
        except asyncio.CancelledError:
            self._requester_gone(entry, deadline, cancelled=True)
            raise
        if not settled:
            self._requester_gone(entry, deadline, cancelled=False)
            if entry.error is not None:
                raise self._error_of(entry)  # failed before the deadline; being undone now
            if not entry.abandoned:
                raise DeadlineExceeded(
                    f"deadline exceeded: {self._kind} creation of {entry.name!r} continues in "
                    "the background; retry with the same name to get it "
                    f"(stage: {entry.stage})"
                )
            raise DeadlineExceeded(
                f"deadline exceeded: {self._kind} creation of {entry.name!r} was abandoned "
                f"at stage {entry.stage!r} and is being rolled back"
            )
        if entry.error is not None:
            raise self._error_of(entry)
        return entry.object_id

    def _requester_gone(self, entry: _Entry, deadline: float | None, *, cancelled: bool) -> None:
        """The reserving request stopped waiting: from now on a finished object is cached."""
        entry.requester_waiting = False
        if deadline is None:
            # A request without a deadline stops waiting only when cancelled: that moment
            # stands in for its deadline when the expiry is computed.
            entry.note_deadline(self._clock())
        if entry.phase is not Phase.IN_FLIGHT:
            return  # already finished or failed: nothing left to decide
        if cancelled:
            self._count("client_gone", entry, "requester cancelled, creation continues")
        else:
            self._count("timed_out", entry, "requester's deadline passed, creation continues")
        if not self._keep_on_timeout:
            self._count("abandoned", entry, "keep_on_timeout is off: cancelling the creation")
            entry.abandoned = True
            if entry.creator_scope is not None:
                entry.creator_scope.cancel()

    def _claim_cached(self, entry: _Entry) -> str:
        """A retry takes the object that was finished for it: publish and return it."""
        # Publish first: if persisting fails, the object stays cached and claimable.
        self._hooks.publish(entry.object_id)
        entry.phase = Phase.VISIBLE
        entry.expires_at = None
        if entry.claimed is not None:
            entry.claimed.set()  # ends the wait for the expiry
        _drop_events(entry)
        self._count("claimed", entry, "claimed from the cache, now visible")
        return entry.object_id

    async def _watch(self, entry: _Entry, deadline: float | None) -> str:
        """A duplicate of a creation in flight: wait, then take the object, or be refused.

        A creation that finishes while the duplicate waits is handed to it (the *hand-off*):
        refusing it, as CRI-O does, makes kubelet back off before the retry that would get
        the object, so the pod starts a whole back-off period later. Handing it over cannot
        leak the object even if this response is lost on the way: it is visible from now on,
        and the next retry with the name gets the same ID (rule 5).
        """
        if not self._keep_on_timeout:
            # containerd-like: no cache to hand the object to later, so waiting buys nothing.
            self._refuse(entry)
        entry.watchers += 1
        if deadline is not None:
            entry.note_deadline(deadline)
        self._count("waiting", entry, f"duplicate request waits (stage: {entry.stage})")
        try:
            await self._wait(entry.settled, deadline)
        except asyncio.CancelledError:
            if deadline is None:
                entry.note_deadline(self._clock())
            raise
        finally:
            entry.watchers -= 1
        if entry.error is not None:
            # Rather than let the client wait out its deadline for an object that will
            # never come (CRI-O does), hand it the creation's error at once.
            log.info("%s %r: duplicate request gets the creation's error", self._kind, entry.name)
            raise self._error_of(entry)
        if self._hand_off and self._handed_over(entry):
            self._count("handed_off", entry, "duplicate request gets the finished object")
            return entry.object_id
        self._refuse(entry)

    def _handed_over(self, entry: _Entry) -> bool:
        """Whether a watcher just woken may be given the object: it was published while it
        waited and still holds the name (not removed in the same instant). A watcher of an
        expiry cleanup wakes with the entry still CLEANING and is refused."""
        return entry.phase is Phase.VISIBLE and self._entries.get(entry.name) is entry

    def _refuse(self, entry: _Entry) -> NoReturn:
        self._count("name_reserved", entry, f"refused: name is reserved (stage: {entry.stage})")
        raise NameReserved(
            f"name {entry.name!r} is reserved for {entry.object_id}: creation in progress "
            f"(stage: {entry.stage}); retry to get it once done"
        )

    async def _wait(self, settled: anyio.Event | None, deadline: float | None) -> bool:
        """Wait for `settled` until `deadline`; True if it was set.

        The creation runs in the coordinator's task group, not in the request's task: a
        request that times out or is cancelled leaves it (and everybody else waiting on it)
        untouched.
        """
        assert settled is not None, "only in-flight and cleaning names are waited on"
        if settled.is_set():
            return True
        timeout = None if deadline is None else max(0.0, deadline - self._clock())
        with anyio.move_on_after(timeout):
            await settled.wait()
        return settled.is_set()

    # ---- the creation, detached from any request -------------------------------------

    async def _life(self, entry: _Entry, run: Creator | None) -> None:
        """One name from its reservation to its release, in the contract's order: run the
        creator, publish or cache what it made, wait for a claim or the expiry, clean up.

        `run` is None for an object restored into the cache (its life starts at the claim)
        and for one the domain retired (its life ends with the cleanup).
        Daemon shutdown cancels this coroutine wherever it is, without cleanup (`aclose`).
        """
        try:
            await self._live(entry, run)
        finally:
            entry.trace.end(str(entry.phase) if entry.phase is not Phase.CLEANING else "released")

    async def _live(self, entry: _Entry, run: Creator | None) -> None:
        if run is not None:
            error = await self._run(entry, run)
            if error is None:
                error = self._publish_or_cache(entry)
            if error is not None:
                self._fail(entry, error)
                await self._clean_up(entry)
                return
        if entry.phase is Phase.CLEANING:
            await self._clean_up(entry)  # retired: removed by the domain
            return
        if entry.phase is not Phase.CACHED or await self._claimed_in_time(entry):
            return  # visible: the domain's from now on, until it calls release() or retire()
        self._expire(entry)
        await self._clean_up(entry)

    async def _run(self, entry: _Entry, run: Creator) -> BaseException | None:
        """Run the creator to its end; the error it ended with, if any.

        Only an abandonment (keep_on_timeout off, the request gave up) cancels the creator's
        scope, so that the coroutine carries on with the rollback; shutdown cancels it all.
        """
        if entry.abandoned:
            return self._abandoned_error(entry)  # gave up before the creation even started
        stage = Stage(lambda new: self._stage_changed(entry, new))
        error: BaseException | None = None
        with anyio.CancelScope() as scope:
            entry.creator_scope = scope
            try:
                await run(entry.object_id, stage)
            except Exception as exc:
                error = exc
        entry.creator_scope = None
        # The last stage ends with the creation, whatever its outcome.
        self._observer.stage_left(entry.stage, self._clock() - entry.stage_since)
        if scope.cancelled_caught:
            return self._abandoned_error(entry)
        return error

    def _publish_or_cache(self, entry: _Entry) -> BaseException | None:
        """The creator is done: whoever waits on it gets the object, else the cache.

        Waiting duplicates count only with `hand_off`: without it they are refused, and the
        object is kept in the cache for their next retry. Returns the error that makes the
        object unusable (a hook failed to persist, or it was abandoned), if any.
        """
        try:
            if entry.requester_waiting:
                self._hooks.publish(entry.object_id)
                entry.phase = Phase.VISIBLE
                self._count("created", entry, "created, now visible")
            elif self._hand_off and entry.watchers > 0:
                self._hooks.publish(entry.object_id)
                entry.phase = Phase.VISIBLE
                entry.trace.settled(handed_to=entry.watchers)
                log.info(
                    "%s %r (%s): finished after its request gave up, while %d duplicate "
                    "request(s) waited; handed to them, now visible",
                    self._kind,
                    entry.name,
                    entry.object_id,
                    entry.watchers,
                )
            elif entry.abandoned:
                # Finished in the instant its request gave up; without a cache it goes.
                return self._abandoned_error(entry)
            else:
                expires_at = self._expiry_time(entry)
                self._hooks.cached(entry.object_id, expires_at)
                entry.phase = Phase.CACHED
                entry.expires_at = expires_at
                self._count(
                    "cached",
                    entry,
                    f"finished after its request gave up; cached for "
                    f"{expires_at - self._clock():.0f}s",
                )
        except Exception as exc:
            return exc
        self._settle(entry)
        return None

    def _expiry_time(self, entry: _Entry) -> float:
        """When an unclaimed object is cleaned up: claim_grace after the last request gave up.

        The clock starts at the latest of the finish time and the deadlines of the original
        request and of every duplicate that waited on the creation, not at the finish
        time. A kubelet retries after its own deadline; counting from the finish instead
        would let a creation that finished early expire just before the retry that would
        have claimed it (CRI-O's fixed reaper has exactly that weakness).
        """
        start = self._clock()
        if entry.latest_deadline is not None:
            start = max(start, entry.latest_deadline)
        return start + self._claim_grace

    async def _claimed_in_time(self, entry: _Entry) -> bool:
        """Wait for a retry to claim the cached object (`_claim_cached`) until it expires."""
        assert entry.expires_at is not None
        entry.claimed = anyio.Event()
        with anyio.move_on_after(max(0.0, entry.expires_at - self._clock())):
            await entry.claimed.wait()
        # Whichever came first decides; from here to CLEANING nothing else runs, so no
        # claim can slip in between.
        return entry.phase is not Phase.CACHED

    def _expire(self, entry: _Entry) -> None:
        entry.phase = Phase.CLEANING
        entry.stage = STAGE_CLEANUP
        entry.stage_since = self._clock()
        # Duplicates arriving during the cleanup wait for the name to be free again.
        entry.settled = anyio.Event()
        self._count("expired", entry, "never claimed; cleaning up")

    def _fail(self, entry: _Entry, error: BaseException) -> None:
        """A creation failed or was abandoned: what waiters will be told, once it is undone.

        Waiting requests are woken only after the name is free (`_clean_up`), so that a
        client retrying at once on the error finds the name available rather than reserved.
        """
        self._count(
            "failed",
            entry,
            f"failed at stage {entry.stage!r}: {error}; rolling back",
            logging.WARNING,
        )
        entry.phase = Phase.CLEANING
        entry.stage = STAGE_CLEANUP
        entry.stage_since = self._clock()
        entry.error = error

    async def _clean_up(self, entry: _Entry) -> None:
        """Run the domain's cleanup within its own budget, then free the name whatever
        happened; failures are logged and counted, not raised."""
        try:
            with anyio.fail_after(self._cleanup_timeout):
                await self._hooks.cleanup(entry.object_id)
        except TimeoutError:
            self._observer.counted("cleanup_failed")
            log.error(
                "%s %r (%s): cleanup did not finish within %.0fs; releasing the name anyway, "
                "what is left is for garbage collection",
                self._kind,
                entry.name,
                entry.object_id,
                self._cleanup_timeout,
            )
        except Exception:
            self._observer.counted("cleanup_failed")
            log.exception(
                "%s %r (%s): cleanup failed; releasing the name anyway",
                self._kind,
                entry.name,
                entry.object_id,
            )
        finally:
            self._release_after_cleanup(entry)

    def _release_after_cleanup(self, entry: _Entry) -> None:
        """Free the name (memory, then database) and wake whoever waits on it.

        Skipped at shutdown: a cleanup interrupted there must stay recorded as reserved, so
        that the restart finds it and runs the journal again.
        """
        if self._closing:
            return
        if self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
        self._registrar.release(entry.name)
        self._count("released", entry, "name released")
        try:
            self._hooks.released(entry.name, entry.object_id)
        except Exception:
            # The name is free in memory; the stale row is found and dropped on restart.
            log.exception("%s %r: persisting the release failed", self._kind, entry.name)
        self._settle(entry)

    def _stage_changed(self, entry: _Entry, stage: str) -> None:
        if entry.phase is not Phase.IN_FLIGHT:
            log.debug(
                "%s %r: ignoring stage %r after the creation ended", self._kind, entry.name, stage
            )
            return
        # Persist before recording, so that memory never says more than the database.
        self._hooks.stage_changed(entry.object_id, stage)
        now = self._clock()
        self._observer.stage_left(entry.stage, now - entry.stage_since)
        entry.stage = stage
        entry.stage_since = now
        self._observer.stage_entered(stage)
        entry.trace.stage(stage)
        log.info("%s %r (%s): stage %s", self._kind, entry.name, entry.object_id, stage)

    def _abandoned_error(self, entry: _Entry) -> DeadlineExceeded:
        return DeadlineExceeded(
            f"deadline exceeded: {self._kind} creation of {entry.name!r} was abandoned at "
            f"stage {entry.stage!r} because its request gave up (keep_on_timeout is off)"
        )

    @staticmethod
    def _error_of(entry: _Entry) -> BaseException:
        assert entry.error is not None
        # One error object goes to every request that waited on the creation: reset its
        # traceback, so that each raise shows its own rather than all of them piled up.
        return entry.error.with_traceback(None)

    @staticmethod
    def _settle(entry: _Entry) -> None:
        if entry.settled is not None:
            entry.settled.set()
            if entry.phase is Phase.VISIBLE:
                _drop_events(entry)

    # ---- the domain's side: removal and restore --------------------------------------

    def release(self, name: str, *, object_id: str | None = None) -> None:
        """The domain removed a visible object: forget it, so that the name is free.

        Memory only: the domain has already deleted the rows. Releasing a free name is a
        no-op. Pass `object_id` to make a late, repeated release harmless when the name has
        meanwhile been given to a new object.
        """
        entry = self._entries.get(name)
        if entry is None or (object_id is not None and entry.object_id != object_id):
            return
        if entry.phase is not Phase.VISIBLE:
            raise FailedPrecondition(
                f"{self._kind} {name!r} is {entry.phase} (stage: {entry.stage}), not visible; "
                "only a visible object can be removed"
            )
        del self._entries[name]
        self._registrar.release(name)
        log.info("%s %r (%s): removed, name released", self._kind, name, entry.object_id)

    def retire(self, name: str, *, object_id: str) -> None:
        """The domain hid a visible object (its row says cleaning): undo it in the
        background with the same cleanup as an expiry, and free the name only at the end.

        The request that removes the object answers at once; the teardown belongs to the
        coordinator's task group (shutdown leaves it to the restart, which rolls the row
        forward from its journal). Until it ends the name stays held: a duplicate waits
        for it and is refused, as during an expiry. Retiring a free name is a no-op.
        """
        entry = self._entries.get(name)
        if entry is None or entry.object_id != object_id:
            return
        if entry.phase is not Phase.VISIBLE:
            raise FailedPrecondition(
                f"{self._kind} {name!r} is {entry.phase} (stage: {entry.stage}), not visible; "
                "only a visible object can be removed"
            )
        entry.phase = Phase.CLEANING
        entry.stage = STAGE_REMOVAL
        entry.stage_since = self._clock()
        entry.settled = anyio.Event()
        self._count("removing", entry, "removed; tearing down in the background")
        self._start(entry, None)

    async def until_released(self, name: str, *, object_id: str) -> None:
        """Wait for the cleanup of `name`'s object, if one is running, to free the name."""
        entry = self._entries.get(name)
        if entry is None or entry.object_id != object_id or entry.phase is not Phase.CLEANING:
            return
        assert entry.settled is not None
        await entry.settled.wait()

    def restore_visible(self, name: str, object_id: str) -> None:
        """After a restart: `name` belongs to a visible object. Persists nothing."""
        self._restore(name, object_id, Phase.VISIBLE)

    def restore_cached(self, name: str, object_id: str) -> float:
        """After a restart: a cached object, claimable again with a fresh expiry, which is
        returned (on the coordinator's clock) for the caller to record.

        The expiry restarts at now + claim_grace: the retries that would have claimed it may
        have failed against the stopped daemon. Calls no hook (the row already says `cached`).
        """
        entry = self._restore(name, object_id, Phase.CACHED)
        entry.expires_at = self._clock() + self._claim_grace
        self._start(entry, None)
        return entry.expires_at

    def _restore(self, name: str, object_id: str, phase: Phase) -> _Entry:
        if self._closing:
            raise Unavailable("cri-shim is shutting down")
        self._registrar.reserve(name, object_id)  # NameTaken if the database holds it twice
        now = self._clock()
        entry = _Entry(
            name=name,
            object_id=object_id,
            phase=phase,
            stage="restored",
            reserved_at=now,
            stage_since=now,
        )
        self._entries[name] = entry
        log.info("%s %r (%s): restored as %s", self._kind, name, object_id, phase)
        return entry

    # ---- inspection ------------------------------------------------------------------

    def lookup(self, name: str) -> NameInfo | None:
        entry = self._entries.get(name)
        if entry is None:
            return None
        return NameInfo(entry.name, entry.object_id, entry.phase, entry.stage, entry.expires_at)

    def identify(self, ref: str) -> tuple[str, str] | None:
        """(object ID, name) of the object whose ID is `ref` or starts with it, when one
        does; for the log context of a request that names an object by its ID."""
        name = self._registrar.name_of(ref)
        if name is not None:
            return ref, name
        found = [e for e in self._entries.values() if e.object_id.startswith(ref)] if ref else []
        if len(found) == 1:
            return found[0].object_id, found[0].name
        return None

    def stats(self) -> CreationStats:
        """Counters and what is in flight, for Status verbose and metrics."""
        now = self._clock()
        in_flight = [e for e in self._entries.values() if e.phase is Phase.IN_FLIGHT]
        phases = Counter(e.phase for e in self._entries.values())
        figures = self._observer.figures()
        return CreationStats(
            kind=self._kind,
            counters=figures["counters"],
            stages_entered=figures["stages_entered"],
            stage_seconds=figures["stage_seconds"],
            stalled_by_stage=dict(Counter(e.stage for e in in_flight)),
            in_flight=[
                InFlightInfo(
                    name=e.name,
                    object_id=e.object_id,
                    stage=e.stage,
                    age_seconds=round(now - e.reserved_at, 3),
                    stage_seconds=round(now - e.stage_since, 3),
                    watchers=e.watchers,
                    requester_waiting=e.requester_waiting,
                )
                for e in in_flight
            ],
            cached=phases[Phase.CACHED],
            visible=phases[Phase.VISIBLE],
            cleaning=phases[Phase.CLEANING],
        )

    # ---- shutdown ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Daemon shutdown: stop every name's coroutine where it is, WITHOUT cleanup.

        Their rows still say reserved / creating / cached, so the restart rolls interrupted
        creations back from the journal and restores cached objects; cleaning up here would
        only race the process exit. Requests still waiting get UNAVAILABLE.
        """
        if self._closing:
            return
        self._closing = True
        busy = [e.name for e in self._entries.values() if e.phase is not Phase.VISIBLE]
        log.info(
            "%s coordinator shutting down; %d name(s) in flight, cached or cleaning are left to "
            "the restart: %s",
            self._kind,
            len(busy),
            ", ".join(busy) or "none",
        )
        for entry in self._entries.values():
            if entry.settled is not None and not entry.settled.is_set():
                # Even a failed creation's waiters get this: its rollback is not done, so
                # only a retry after the restart can tell whether the name is free.
                entry.error = Unavailable(
                    f"cri-shim is shutting down during the creation of {entry.name!r}; "
                    "retry once it is back"
                )
                entry.settled.set()
        if self._group is not None:
            self._group.cancel_scope.cancel()
        if self._group_host is not None:
            await self._group_host

    # ---- task ownership ----------------------------------------------------------------

    def _start(self, entry: _Entry, run: Creator | None) -> None:
        """Start the name's coroutine in the coordinator's task group.

        Synchronous, so that a reservation and the start of its creation are one step. The
        group is opened by its host task on first use; until that task runs, what is to
        start waits in a list that the host drains.

        The coroutine's log lines are about `entry`'s object, bound now, in a copy of the
        caller's context: it outlives the request that started it, and runs the domain's
        creator and cleanup.
        """
        context = logcontext.context_for(self._kind, entry.object_id, entry.name)
        if run is not None:
            context.run(entry.trace.enter)  # the creation's work belongs to its trace
        if self._group is not None:
            self._start_in(self._group, entry, run, context)
            return
        self._not_started.append((entry, run, context))
        if self._group_host is None or self._group_host.done():
            self._group_host = asyncio.get_running_loop().create_task(
                self._host_group(), name=f"{self._kind} creations"
            )

    async def _host_group(self) -> None:
        """Hold the task group of the names' coroutines open until `aclose` cancels it."""
        try:
            async with anyio.create_task_group() as group:
                if self._closing:
                    return  # closed before this task first ran: nothing is started
                self._group = group
                for entry, run, context in self._not_started:
                    self._start_in(group, entry, run, context)
                self._not_started.clear()
                await anyio.sleep_forever()
        finally:
            self._group = None

    def _start_in(
        self,
        group: anyio.abc.TaskGroup,
        entry: _Entry,
        run: Creator | None,
        context: contextvars.Context,
    ) -> None:
        # A task copies the context it is created in: started inside `context`, the
        # coroutine runs in a copy of it.
        name = f"{self._kind} {entry.name}"
        context.run(lambda: group.start_soon(self._own, entry, run, name=name))

    async def _own(self, entry: _Entry, run: Creator | None) -> None:
        # A bug in one name's life must not cancel every other name's (the group would).
        try:
            await self._life(entry, run)
        except Exception:
            log.exception(
                "%s %r (%s): its coroutine failed", self._kind, entry.name, entry.object_id
            )

    def _count(self, counter: str, entry: _Entry, message: str, level: int = logging.INFO) -> None:
        self._observer.counted(counter)
        entry.trace.counted(counter, entry.stage)
        log.log(level, "%s %r (%s): %s", self._kind, entry.name, entry.object_id, message)


def _drop_events(entry: _Entry) -> None:
    """A visible object's events, once set, have woken every waiter (each holds its own
    reference) and no request waits on a visible name again: kept, they are ~1 KiB an
    object (an asyncio event and its deque) for as long as the object lives."""
    entry.settled = None
    entry.claimed = None


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _random_id() -> str:
    # 64 hex digits, like the IDs CRI-O and containerd hand out; from the kernel's CSPRNG
    # as secrets' are (that module brings hmac and random along, for nothing here).
    return os.urandom(32).hex()
