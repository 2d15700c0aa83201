"""The cache of finished, unclaimed objects (the ResourceCache of DESIGN §2): a creation
that ends after its request has gone is kept here, invisible, until a retry claims it
(rule 4) or it expires and is cleaned up (rule 7).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cri_shim.creation.entry import STAGE_CLEANUP, Entry, Phase, abandoned_error
from cri_shim.creation.reservation import HeldNames

log = logging.getLogger("cri_shim.creation")


class UnclaimedCache:
    """Publishes or caches what a creation made, hands cached objects to retries, and
    decides when an unclaimed one expires."""

    def __init__(self, names: HeldNames, *, claim_grace: float, hand_off: bool) -> None:
        self._names = names
        self._claim_grace = claim_grace
        self._hand_off = hand_off

    def publish_or_cache(self, entry: Entry) -> BaseException | None:
        """The creator is done: whoever waits on it gets the object, else the cache.

        Waiting duplicates count only with `hand_off`: without it they are refused, and the
        object is kept in the cache for their next retry. Returns the error that makes the
        object unusable (a hook failed to persist, or it was abandoned), if any.
        """
        names = self._names
        try:
            if entry.requester_waiting:
                names.hooks.publish(entry.object_id)
                entry.phase = Phase.VISIBLE
                names.count("created", entry, "created, now visible")
            elif self._hand_off and entry.watchers > 0:
                names.hooks.publish(entry.object_id)
                entry.phase = Phase.VISIBLE
                entry.trace.settled(handed_to=entry.watchers)
                log.info(
                    "%s %r (%s): finished after its request gave up, while %d duplicate "
                    "request(s) waited; handed to them, now visible",
                    names.kind,
                    entry.name,
                    entry.object_id,
                    entry.watchers,
                )
            elif entry.abandoned:
                # Finished in the instant its request gave up; without a cache it goes.
                return abandoned_error(names.kind, entry)
            else:
                expires_at = self.expiry_time(entry)
                names.hooks.cached(entry.object_id, expires_at)
                entry.phase = Phase.CACHED
                entry.expires_at = expires_at
                names.count(
                    "cached",
                    entry,
                    f"finished after its request gave up; cached for "
                    f"{expires_at - names.clock():.0f}s",
                )
        except Exception as exc:
            return exc
        entry.settle()
        return None

    def expiry_time(self, entry: Entry) -> float:
        """When an unclaimed object is cleaned up: claim_grace after the last request gave up.

        The clock starts at the latest of the finish time and the deadlines of the original
        request and of every duplicate that waited on the creation, not at the finish
        time. A kubelet retries after its own deadline; counting from the finish instead
        would let a creation that finished early expire just before the retry that would
        have claimed it (CRI-O's fixed reaper has exactly that weakness).
        """
        start = self._names.clock()
        if entry.latest_deadline is not None:
            start = max(start, entry.latest_deadline)
        return start + self._claim_grace

    def fresh_expiry(self) -> float:
        """The expiry of an object restored into the cache: claim_grace from now, since the
        retries that would have claimed it may have failed against the stopped daemon."""
        return self._names.clock() + self._claim_grace

    def claim(self, entry: Entry) -> str:
        """A retry takes the object that was finished for it: publish and return it."""
        # Publish first: if persisting fails, the object stays cached and claimable.
        self._names.hooks.publish(entry.object_id)
        entry.phase = Phase.VISIBLE
        entry.expires_at = None
        if entry.claimed is not None:
            entry.claimed.set()  # ends the wait for the expiry
        entry.drop_events()
        self._names.count("claimed", entry, "claimed from the cache, now visible")
        return entry.object_id

    async def claimed_in_time(self, entry: Entry) -> bool:
        """Wait for a retry to claim the cached object (`claim`) until it expires."""
        assert entry.expires_at is not None
        entry.claimed = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, entry.expires_at - self._names.clock())):
                await entry.claimed.wait()
        # Whichever came first decides; from here to CLEANING nothing else runs, so no
        # claim can slip in between.
        return entry.phase is not Phase.CACHED

    def expire(self, entry: Entry) -> None:
        entry.enter(Phase.CLEANING, STAGE_CLEANUP, self._names.clock())
        # Duplicates arriving during the cleanup wait for the name to be free again.
        entry.settled = asyncio.Event()
        self._names.count("expired", entry, "never claimed; cleaning up")
