"""The requests that wait on a creation in flight: the one that reserved the name, until
its deadline, and its duplicates, who are handed the finished object, told its error or
refused with `name is reserved` (DESIGN §2, rules 2, 3 and 6).

The creation runs in the coordinator's task group, not in a request's task: a request that
times out or is cancelled leaves it (and everybody else waiting on it) untouched. What a
request's leaving changes is decided here: from then on a finished object is cached, or,
with `keep_on_timeout` off, the creation is abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import NoReturn

from cri_shim.creation.entry import Entry, Phase
from cri_shim.creation.reservation import HeldNames
from cri_shim.errors import DeadlineExceeded, NameReserved

log = logging.getLogger("cri_shim.creation")


class Waiters:
    """How each request waits on a creation, and what it is answered."""

    def __init__(self, names: HeldNames, *, keep_on_timeout: bool, hand_off: bool) -> None:
        self._names = names
        self._keep_on_timeout = keep_on_timeout
        self._hand_off = hand_off

    async def await_own_creation(self, entry: Entry, deadline: float | None) -> str:
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
                raise entry.error_to_raise()  # failed before the deadline; being undone now
            kind = self._names.kind
            if not entry.abandoned:
                raise DeadlineExceeded(
                    f"deadline exceeded: {kind} creation of {entry.name!r} continues in "
                    "the background; retry with the same name to get it "
                    f"(stage: {entry.stage})"
                )
            raise DeadlineExceeded(
                f"deadline exceeded: {kind} creation of {entry.name!r} was abandoned "
                f"at stage {entry.stage!r} and is being rolled back"
            )
        if entry.error is not None:
            raise entry.error_to_raise()
        return entry.object_id

    def _requester_gone(self, entry: Entry, deadline: float | None, *, cancelled: bool) -> None:
        """The reserving request stopped waiting: from now on a finished object is cached."""
        entry.requester_waiting = False
        if deadline is None:
            # A request without a deadline stops waiting only when cancelled: that moment
            # stands in for its deadline when the expiry is computed.
            entry.note_deadline(self._names.clock())
        if entry.phase is not Phase.IN_FLIGHT:
            return  # already finished or failed: nothing left to decide
        count = self._names.count
        if cancelled:
            count("client_gone", entry, "requester cancelled, creation continues")
        else:
            count("timed_out", entry, "requester's deadline passed, creation continues")
        if not self._keep_on_timeout:
            count("abandoned", entry, "keep_on_timeout is off: cancelling the creation")
            entry.abandoned = True
            if entry.creator_scope is not None:
                entry.creator_scope.cancel()

    async def watch(self, entry: Entry, deadline: float | None) -> str:
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
        self._names.count("waiting", entry, f"duplicate request waits (stage: {entry.stage})")
        try:
            await self._wait(entry.settled, deadline)
        except asyncio.CancelledError:
            if deadline is None:
                entry.note_deadline(self._names.clock())
            raise
        finally:
            entry.watchers -= 1
        if entry.error is not None:
            # Rather than let the client wait out its deadline for an object that will
            # never come (CRI-O does), hand it the creation's error at once.
            log.info(
                "%s %r: duplicate request gets the creation's error", self._names.kind, entry.name
            )
            raise entry.error_to_raise()
        if self._hand_off and self._handed_over(entry):
            self._names.count("handed_off", entry, "duplicate request gets the finished object")
            return entry.object_id
        self._refuse(entry)

    def _handed_over(self, entry: Entry) -> bool:
        """Whether a watcher just woken may be given the object: it was published while it
        waited and still holds the name (not removed in the same instant). A watcher of an
        expiry cleanup wakes with the entry still CLEANING and is refused."""
        return entry.phase is Phase.VISIBLE and self._names.holds(entry)

    def _refuse(self, entry: Entry) -> NoReturn:
        self._names.count(
            "name_reserved", entry, f"refused: name is reserved (stage: {entry.stage})"
        )
        raise NameReserved(
            f"name {entry.name!r} is reserved for {entry.object_id}: creation in progress "
            f"(stage: {entry.stage}); retry to get it once done"
        )

    async def _wait(self, settled: asyncio.Event | None, deadline: float | None) -> bool:
        """Wait for `settled` until `deadline`; True if it was set."""
        assert settled is not None, "only in-flight and cleaning names are waited on"
        if settled.is_set():
            return True
        timeout = None if deadline is None else max(0.0, deadline - self._names.clock())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await settled.wait()
        return settled.is_set()
