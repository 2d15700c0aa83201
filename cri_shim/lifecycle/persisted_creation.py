"""The creation coordinator's persistence hooks, one instance per kind of object.

Each hook writes the state database in the same step as the coordinator's in-memory
change, so that a restart finds reservations, stages and cached objects as they were.
The lifecycle that owns a coordinator builds these hooks with what is its own to do (the
event a publish announces, what a cleanup removes first) and hands them to the
coordinator; neither passes itself to the other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from cri_shim import tracing
from cri_shim.config.model import CreationConfig
from cri_shim.creation.coordinator import CreationCoordinator, Phase
from cri_shim.logcontext import object_bound
from cri_shim.state.journal import Journal, UndoFailed
from cri_shim.state.objects import ObjectRepository

log = logging.getLogger("cri_shim.restore")


async def _nothing_first(object_id: str) -> None:
    return None


class PersistedCreationHooks:
    """`CreationHooks` written through one kind's rows, undone through its journal."""

    def __init__(
        self,
        rows: ObjectRepository[Any],
        journal: Journal,
        cleanup_budget: float,
        *,
        published: Callable[[str], None],
        before_undo: Callable[[str], Awaitable[None]] = _nothing_first,
        after_forget: Callable[[str], Awaitable[None]] = _nothing_first,
    ) -> None:
        self._rows = rows
        self._journal = journal
        self._cleanup_budget = cleanup_budget
        self._published = published
        self._before_undo = before_undo
        self._after_forget = after_forget

    def reserve(self, name: str, object_id: str) -> None:
        self._rows.reserve_name(name, object_id)

    def stage_changed(self, object_id: str, stage: str) -> None:
        self._rows.set_stage(object_id, stage)

    def cached(self, object_id: str, expires_at: float) -> None:
        self._rows.mark_cached(object_id, _wall_clock(expires_at))

    def publish(self, object_id: str) -> None:
        self._rows.mark_visible(object_id)
        self._published(object_id)

    async def cleanup(self, object_id: str) -> None:
        # Before the first await: a crash from here on must roll the object back at
        # restart, never restore a half-undone object as claimable.
        self._rows.mark_cleaning(object_id)
        try:
            await self._before_undo(object_id)
            await self._journal.undo(object_id, budget=self._cleanup_budget)
        finally:
            self._rows.forget(object_id)
        await self._after_forget(object_id)

    def released(self, name: str, object_id: str) -> None:
        self._rows.release_name(name, object_id)


def persisted_coordinator(
    kind: str,
    rows: ObjectRepository[Any],
    journal: Journal,
    settings: CreationConfig,
    *,
    published: Callable[[str], None],
    before_undo: Callable[[str], Awaitable[None]] = _nothing_first,
    after_forget: Callable[[str], Awaitable[None]] = _nothing_first,
    tracer: tracing.Tracer = tracing.NO_TRACER,
) -> CreationCoordinator:
    """The coordinator of one kind of object, persisting through its rows and journal."""
    hooks = PersistedCreationHooks(
        rows,
        journal,
        settings.cleanup_timeout,
        published=published,
        before_undo=before_undo,
        after_forget=after_forget,
    )
    return CreationCoordinator(
        kind,
        hooks,
        claim_grace=settings.claim_grace,
        keep_on_timeout=settings.keep_on_timeout,
        hand_off=settings.hand_off,
        cleanup_timeout=settings.cleanup_timeout,
        tracer=tracer,
    )


async def restore_creations(
    rows: ObjectRepository[Any],
    coordinator: CreationCoordinator,
    journal: Journal,
    cleanup_budget: float,
) -> None:
    """Before serving: roll back what a crash interrupted (a creation, or a cleanup),
    hand cached objects back to the coordinator with a fresh expiry, re-register the
    visible ones, and drop reservations that never got a row."""
    for row in rows.phases():
        with object_bound(rows.kind, row.id, row.name):
            if row.phase == Phase.CACHED:
                expires_at = coordinator.restore_cached(row.name, row.id)
                rows.extend_cached(row.id, _wall_clock(expires_at))
            elif row.phase == Phase.VISIBLE:
                coordinator.restore_visible(row.name, row.id)
            else:
                log.warning(
                    "%s %s (%s): %s was interrupted; rolling it back",
                    rows.kind,
                    row.id,
                    row.name,
                    row.phase,
                )
                try:
                    await journal.undo(row.id, budget=cleanup_budget)
                except UndoFailed as exc:
                    log.error("%s %s: rollback left work for GC: %s", rows.kind, row.id, exc)
                rows.forget(row.id)
    rows.drop_names_without_rows()


def _wall_clock(expires_at: float) -> float:
    """The coordinator's clock is the loop's; rows keep wall-clock time for humans."""
    return time.time() + max(0.0, expires_at - asyncio.get_running_loop().time())
