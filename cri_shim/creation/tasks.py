"""Ownership of the names' coroutines: one task group, held open by one task, which the
coordinator's shutdown cancels. No coroutine is fire-and-forget: each belongs to the group,
and a bug in one is logged without cancelling the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

from cri_shim import logcontext
from cri_shim.creation.entry import Creator, Entry

log = logging.getLogger("cri_shim.creation")

Life = Callable[[Entry, Creator | None], Awaitable[None]]


class NameTasks:
    """Starts `life(entry, run)` for a name in the group; `aclose` cancels them all."""

    def __init__(self, kind: str, life: Life) -> None:
        self._kind = kind
        self._life = life
        # The task group of the names' coroutines, and the task that holds it open.
        self._group: anyio.abc.TaskGroup | None = None
        self._group_host: asyncio.Task[None] | None = None
        self._not_started: list[tuple[Entry, Creator | None, contextvars.Context]] = []
        self._closing = False

    def start(self, entry: Entry, run: Creator | None) -> None:
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

    async def aclose(self) -> None:
        """Cancel every name's coroutine where it is, and wait for the group to close."""
        self._closing = True
        if self._group is not None:
            self._group.cancel_scope.cancel()
        if self._group_host is not None:
            await self._group_host

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
        entry: Entry,
        run: Creator | None,
        context: contextvars.Context,
    ) -> None:
        # A task copies the context it is created in: started inside `context`, the
        # coroutine runs in a copy of it.
        name = f"{self._kind} {entry.name}"
        context.run(lambda: group.start_soon(self._own, entry, run, name=name))

    async def _own(self, entry: Entry, run: Creator | None) -> None:
        # A bug in one name's life must not cancel every other name's (the group would).
        try:
            await self._life(entry, run)
        except Exception:
            log.exception(
                "%s %r (%s): its coroutine failed", self._kind, entry.name, entry.object_id
            )
