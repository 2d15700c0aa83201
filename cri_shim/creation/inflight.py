"""One name's life, detached from any request: run the creator, publish or cache what it
made, wait for a claim or the expiry, clean up (DESIGN §2, rules 2, 6, 7 and 8).

The life runs as a coroutine of the coordinator's task group (tasks.py), so the request
that started it may go without cancelling it. Only an abandonment (keep_on_timeout off,
the request gave up) cancels the creator, and the life carries on with the rollback;
daemon shutdown cancels the whole life wherever it is, without cleanup.
"""

from __future__ import annotations

import asyncio
import logging

from cri_shim.creation.cache import UnclaimedCache
from cri_shim.creation.entry import (
    STAGE_CLEANUP,
    Creator,
    CreatorScope,
    Entry,
    Phase,
    Stage,
    abandoned_error,
)
from cri_shim.creation.reservation import HeldNames

log = logging.getLogger("cri_shim.creation")


class DetachedCreations:
    """The lives of the names, in the contract's order."""

    def __init__(self, names: HeldNames, cache: UnclaimedCache, *, cleanup_timeout: float) -> None:
        self._names = names
        self._cache = cache
        self._cleanup_timeout = cleanup_timeout

    async def life(self, entry: Entry, run: Creator | None) -> None:
        """One name from its reservation to its release.

        `run` is None for an object restored into the cache (its life starts at the claim)
        and for one the domain retired (its life ends with the cleanup).
        """
        try:
            await self._live(entry, run)
        finally:
            entry.trace.end(str(entry.phase) if entry.phase is not Phase.CLEANING else "released")

    async def _live(self, entry: Entry, run: Creator | None) -> None:
        if run is not None:
            error = await self._run(entry, run)
            if error is None:
                error = self._cache.publish_or_cache(entry)
            if error is not None:
                self._fail(entry, error)
                await self._clean_up(entry)
                return
        if entry.phase is Phase.CLEANING:
            await self._clean_up(entry)  # retired: removed by the domain
            return
        if entry.phase is not Phase.CACHED or await self._cache.claimed_in_time(entry):
            return  # visible: the domain's from now on, until it calls release() or retire()
        self._cache.expire(entry)
        await self._clean_up(entry)

    async def _run(self, entry: Entry, run: Creator) -> BaseException | None:
        """Run the creator to its end; the error it ended with, if any.

        Only an abandonment cancels the creator's scope, so that the coroutine carries on
        with the rollback; shutdown cancels it all.
        """
        if entry.abandoned:
            # Gave up before the creation even started.
            return abandoned_error(self._names.kind, entry)
        stage = Stage(lambda new: self._stage_changed(entry, new))
        error: BaseException | None = None
        scope = entry.creator_scope = CreatorScope()
        try:
            await run(entry.object_id, stage)
        except asyncio.CancelledError:
            if not scope.withdraw():
                raise  # shutdown (too): the whole life ends here
        except Exception as exc:
            error = exc
        entry.creator_scope = None
        # The last stage ends with the creation, whatever its outcome.
        self._names.observer.stage_left(entry.stage, self._names.clock() - entry.stage_since)
        if scope.cancelled:
            scope.withdraw()  # a creator that finished despite it is rolled back all the same
            return abandoned_error(self._names.kind, entry)
        return error

    def _stage_changed(self, entry: Entry, stage: str) -> None:
        names = self._names
        if entry.phase is not Phase.IN_FLIGHT:
            log.debug(
                "%s %r: ignoring stage %r after the creation ended", names.kind, entry.name, stage
            )
            return
        # Persist before recording, so that memory never says more than the database.
        names.hooks.stage_changed(entry.object_id, stage)
        now = names.clock()
        names.observer.stage_left(entry.stage, now - entry.stage_since)
        entry.stage = stage
        entry.stage_since = now
        names.observer.stage_entered(stage)
        entry.trace.stage(stage)
        log.info("%s %r (%s): stage %s", names.kind, entry.name, entry.object_id, stage)

    def _fail(self, entry: Entry, error: BaseException) -> None:
        """A creation failed or was abandoned: what waiters will be told, once it is undone.

        Waiting requests are woken only after the name is free (`_clean_up`), so that a
        client retrying at once on the error finds the name available rather than reserved.
        """
        self._names.count(
            "failed",
            entry,
            f"failed at stage {entry.stage!r}: {error}; rolling back",
            logging.WARNING,
        )
        entry.enter(Phase.CLEANING, STAGE_CLEANUP, self._names.clock())
        entry.error = error

    async def _clean_up(self, entry: Entry) -> None:
        """Run the domain's cleanup within its own budget, then free the name whatever
        happened; failures are logged and counted, not raised."""
        names = self._names
        try:
            async with asyncio.timeout(self._cleanup_timeout):
                await names.hooks.cleanup(entry.object_id)
        except TimeoutError:
            names.observer.counted("cleanup_failed")
            log.error(
                "%s %r (%s): cleanup did not finish within %.0fs; releasing the name anyway, "
                "what is left is for garbage collection",
                names.kind,
                entry.name,
                entry.object_id,
                self._cleanup_timeout,
            )
        except Exception:
            names.observer.counted("cleanup_failed")
            log.exception(
                "%s %r (%s): cleanup failed; releasing the name anyway",
                names.kind,
                entry.name,
                entry.object_id,
            )
        finally:
            names.release_after_cleanup(entry)
