"""Idempotent creation under client deadlines: the contract of DESIGN §2, and nothing else.

The coordinator owns the life of a *name*, from its reservation to its release: one
coroutine per name runs the creation (detached from the request that started it), publishes
or caches what it made, waits for a claim or the expiry, and cleans up. These coroutines
belong to the coordinator's task group, which `aclose()` (daemon shutdown) cancels. It does
no I/O of its own: the domain layer does the work in the creator it passes to `create()` and
persists every decision through `CreationHooks`, in the same step as the memory change; what
happens is counted by a `CreationObserver` (statistics.py).

This module is the front the domain calls; each concern is a module of its own:

- reservation.py: the held names, taken and freed in step with the database;
- waiters.py: the requests waiting on a creation, and what each is answered;
- inflight.py: a name's life detached from requests: creator, failure, cleanup;
- cache.py: the finished, unclaimed objects, their claim and their expiry;
- restore.py: the names taken again after a restart;
- tasks.py: the task group the names' coroutines belong to.

The phases of a name are drawn in entry.py. Every method must be called from the event
loop's thread. Deadlines are absolute times on the coordinator's clock, which is the event
loop's clock (`loop.time()`) unless one is injected. Waits are turned into delays on that
clock and slept on the loop, so an injected clock must run at the loop's pace; tests that
want virtual time run a virtual-time loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable

from cri_shim import logcontext, tracing
from cri_shim.creation import restore
from cri_shim.creation.cache import UnclaimedCache
from cri_shim.creation.entry import (
    STAGE_REMOVAL,
    CreationHooks,
    Creator,
    NameInfo,
    Phase,
    Stage,
)
from cri_shim.creation.inflight import DetachedCreations
from cri_shim.creation.reservation import HeldNames
from cri_shim.creation.statistics import (
    CreationObserver,
    CreationStatistics,
    CreationStats,
    InFlightInfo,
)
from cri_shim.creation.tasks import NameTasks
from cri_shim.creation.waiters import Waiters
from cri_shim.errors import Unavailable

__all__ = [
    "CreationCoordinator",
    "CreationHooks",
    "Creator",
    "NameInfo",
    "Phase",
    "Stage",
]

log = logging.getLogger("cri_shim.creation")


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
        self._names = HeldNames(
            kind,
            hooks,
            clock=clock if clock is not None else _loop_time,
            new_id=new_id if new_id is not None else _random_id,
            observer=observer if observer is not None else CreationStatistics(),
            tracer=tracer,
        )
        self._waiters = Waiters(self._names, keep_on_timeout=keep_on_timeout, hand_off=hand_off)
        self._cache = UnclaimedCache(self._names, claim_grace=claim_grace, hand_off=hand_off)
        creations = DetachedCreations(self._names, self._cache, cleanup_timeout=cleanup_timeout)
        self._tasks = NameTasks(kind, creations.life)

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
        if self._names.closing:
            raise Unavailable(f"cri-shim is shutting down; retry {name!r} once it is back")
        entry = self._names.get(name)
        if entry is None:
            # Synchronous up to the start: no other request can see the name free between.
            entry = self._names.reserve(name)
            self._tasks.start(entry, run)
            return await self._waiters.await_own_creation(entry, deadline)
        # The rest of the request is about this object, its log lines included.
        logcontext.bind_object(self._kind, entry.object_id, entry.name)
        if entry.phase is Phase.VISIBLE:
            # The same request again: its response was lost or it raced its own retry.
            # Answering with the object (as CRI-O does) is what keeps a claimed object from
            # ever leaking: the client can always get the ID it was owed.
            self._names.count("returned_existing", entry, "already visible, returning it")
            return entry.object_id
        if entry.phase is Phase.CACHED:
            return self._cache.claim(entry)
        return await self._waiters.watch(entry, deadline)

    # ---- the domain's side: removal and restore --------------------------------------

    def release(self, name: str, *, object_id: str | None = None) -> None:
        """The domain removed a visible object: forget it, so that the name is free.

        Memory only: the domain has already deleted the rows. Releasing a free name is a
        no-op. Pass `object_id` to make a late, repeated release harmless when the name has
        meanwhile been given to a new object.
        """
        entry = self._names.visible(name, object_id)
        if entry is not None:
            self._names.release_removed(entry)

    def retire(self, name: str, *, object_id: str) -> None:
        """The domain hid a visible object (its row says cleaning): undo it in the
        background with the same cleanup as an expiry, and free the name only at the end.

        The request that removes the object answers at once; the teardown belongs to the
        coordinator's task group (shutdown leaves it to the restart, which rolls the row
        forward from its journal). Until it ends the name stays held: a duplicate waits
        for it and is refused, as during an expiry. Retiring a free name is a no-op.
        """
        entry = self._names.visible(name, object_id)
        if entry is None:
            return
        entry.enter(Phase.CLEANING, STAGE_REMOVAL, self._names.clock())
        entry.settled = asyncio.Event()
        self._names.count("removing", entry, "removed; tearing down in the background")
        self._tasks.start(entry, None)

    async def until_released(self, name: str, *, object_id: str) -> None:
        """Wait for the cleanup of `name`'s object, if one is running, to free the name."""
        entry = self._names.get(name)
        if entry is None or entry.object_id != object_id or entry.phase is not Phase.CLEANING:
            return
        assert entry.settled is not None
        await entry.settled.wait()

    def restore_visible(self, name: str, object_id: str) -> None:
        """After a restart: `name` belongs to a visible object. Persists nothing."""
        restore.restore_visible(self._names, name, object_id)

    def restore_cached(self, name: str, object_id: str) -> float:
        """After a restart: a cached object, claimable again with a fresh expiry, which is
        returned (on the coordinator's clock) for the caller to record.

        The expiry restarts at now + claim_grace: the retries that would have claimed it may
        have failed against the stopped daemon. Calls no hook (the row already says `cached`).
        """
        entry = restore.restore_cached(self._names, self._cache, name, object_id)
        self._tasks.start(entry, None)
        assert entry.expires_at is not None
        return entry.expires_at

    # ---- inspection ------------------------------------------------------------------

    def lookup(self, name: str) -> NameInfo | None:
        return self._names.lookup(name)

    def identify(self, ref: str) -> tuple[str, str] | None:
        """(object ID, name) of the object whose ID is `ref` or starts with it, when one
        does; for the log context of a request that names an object by its ID."""
        return self._names.identify(ref)

    def stats(self) -> CreationStats:
        """Counters and what is in flight, for Status verbose and metrics."""
        now = self._names.clock()
        entries = list(self._names.entries())
        in_flight = [e for e in entries if e.phase is Phase.IN_FLIGHT]
        phases = Counter(e.phase for e in entries)
        figures = self._names.observer.figures()
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
        if self._names.closing:
            return
        self._names.closing = True
        entries = list(self._names.entries())
        busy = [e.name for e in entries if e.phase is not Phase.VISIBLE]
        log.info(
            "%s coordinator shutting down; %d name(s) in flight, cached or cleaning are left to "
            "the restart: %s",
            self._kind,
            len(busy),
            ", ".join(busy) or "none",
        )
        for entry in entries:
            if entry.settled is not None and not entry.settled.is_set():
                # Even a failed creation's waiters get this: its rollback is not done, so
                # only a retry after the restart can tell whether the name is free.
                entry.error = Unavailable(
                    f"cri-shim is shutting down during the creation of {entry.name!r}; "
                    "retry once it is back"
                )
                entry.settled.set()
        await self._tasks.aclose()


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _random_id() -> str:
    # 64 hex digits, like the IDs CRI-O and containerd hand out; from the kernel's CSPRNG
    # as secrets' are (that module brings hmac and random along, for nothing here).
    return os.urandom(32).hex()
