"""One teardown at a time per object: a second stop or removal of a pod, or a second
removal of a container, waits for the one under way and then finds what it left.

Unserialized, two RemoveContainer calls for one container both find it visible, both
announce its deletion, and the second is refused when it comes to retire a name the
first has already retired; two StopPodSandbox calls run one journal's undo steps twice.
A caller that waited re-reads the object under the lock: gone (removed) is success, as
removing an absent object is in the CRI; still there (the first call failed) means it
tries itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


class _Identified(Protocol):
    @property
    def id(self) -> str: ...


Found = TypeVar("Found", bound=_Identified)


@dataclass
class _Held:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0  # the holder and its waiters


class ObjectLocks:
    """A lock per object ID, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    @contextlib.asynccontextmanager
    async def held(self, object_id: str) -> AsyncIterator[None]:
        entry = self._held.setdefault(object_id, _Held())
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._held[object_id]

    @contextlib.asynccontextmanager
    async def current(
        self, find: Callable[[str], Found | None], ref: str
    ) -> AsyncIterator[Found | None]:
        """The object `ref` names, read again once its lock is held: None when there is
        none, or when a call that held the lock first took it away meanwhile."""
        found = find(ref)
        if found is None:
            yield None
            return
        async with self.held(found.id):
            yield find(found.id)

    def __len__(self) -> int:
        """How many objects are locked or waited on (none once every call has ended)."""
        return len(self._held)
