"""Ownership of the names' coroutines: each a task the coordinator holds until it ends,
which the coordinator's shutdown cancels. No coroutine is fire-and-forget: each is held
here, and a bug in one is logged without cancelling the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

from cri_shim import logcontext
from cri_shim.creation.entry import Creator, Entry

log = logging.getLogger("cri_shim.creation")

Life = Callable[[Entry, Creator | None], Awaitable[None]]


class NameTasks:
    """Starts `life(entry, run)` for a name as a task; `aclose` cancels them all."""

    def __init__(self, kind: str, life: Life) -> None:
        self._kind = kind
        self._life = life
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False

    def start(self, entry: Entry, run: Creator | None) -> None:
        """Start the name's coroutine as a task of its own.

        Synchronous, so that a reservation and the start of its creation are one step.
        Once `aclose` has begun nothing more is started.

        The coroutine's log lines are about `entry`'s object, bound now, in a copy of the
        caller's context: it outlives the request that started it, and runs the domain's
        creator and cleanup.
        """
        if self._closing:
            return
        context = logcontext.context_for(self._kind, entry.object_id, entry.name)
        if run is not None:
            context.run(entry.trace.enter)  # the creation's work belongs to its trace
        self._start_in(context, entry, run)

    async def aclose(self) -> None:
        """Cancel every name's coroutine where it is, and wait for them to end."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start_in(self, context: contextvars.Context, entry: Entry, run: Creator | None) -> None:
        # The coroutine runs in a copy of `context`, as a task copies the one it is made in.
        task = asyncio.get_running_loop().create_task(
            self._own(entry, run), name=f"{self._kind} {entry.name}", context=context.copy()
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _own(self, entry: Entry, run: Creator | None) -> None:
        # A bug in one name's life must not end any other name's.
        try:
            await self._life(entry, run)
        except Exception:
            log.exception(
                "%s %r (%s): its coroutine failed", self._kind, entry.name, entry.object_id
            )
