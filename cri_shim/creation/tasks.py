"""Ownership of the names' coroutines: each one a task the coordinator holds until it
ends, and which its shutdown cancels and awaits. No coroutine is fire-and-forget, and a
bug in one is logged without touching the others.
"""

from __future__ import annotations

import asyncio
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
        """Start the name's coroutine; after `aclose`, start nothing.

        Synchronous, so that a reservation and the start of its creation are one step.
        The coroutine's log lines are about `entry`'s object, bound now, in a copy of the
        caller's context: it outlives the request that started it, and runs the domain's
        creator and cleanup.
        """
        if self._closing:
            return
        context = logcontext.context_for(self._kind, entry.object_id, entry.name)
        if run is not None:
            context.run(entry.trace.enter)  # the creation's work belongs to its trace
        task = asyncio.get_running_loop().create_task(
            self._own(entry, run), name=f"{self._kind} {entry.name}", context=context
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Cancel every name's coroutine where it is, and wait for them to end."""
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _own(self, entry: Entry, run: Creator | None) -> None:
        # A bug in one name's life must not end the others'.
        try:
            await self._life(entry, run)
        except Exception:
            log.exception(
                "%s %r (%s): its coroutine failed", self._kind, entry.name, entry.object_id
            )
