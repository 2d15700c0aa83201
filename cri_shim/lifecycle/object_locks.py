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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


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

    def __len__(self) -> int:
        """How many objects are locked or waited on (none once every call has ended)."""
        return len(self._held)
