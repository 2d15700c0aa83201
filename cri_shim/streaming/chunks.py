"""A bounded hand-over of byte chunks from one producer to one consumer.

The streaming server reads from sockets it does not control: a client that sends stdin
faster than the process reads it, or a container whose output an attach client does not
read, must not make the daemon buffer without limit. The producer awaits `put` while the
queue holds `limit` bytes or more, so it stops reading its socket and TCP (or conmon's
socket) pushes back on the sender.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ChunkQueue:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._ended = False
        self._changed = asyncio.Event()

    @property
    def buffered(self) -> int:
        return self._size

    async def put(self, chunk: bytes) -> None:
        """Wait for room, then queue `chunk` (a chunk larger than the limit still fits
        into an empty queue). After `end()` chunks are dropped: nobody will read them."""
        while self._size >= self._limit and not self._ended:
            self._changed.clear()
            await self._changed.wait()
        if self._ended:
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        self._changed.set()

    def end(self) -> None:
        """No more chunks: the consumer gets what is queued, then None."""
        self._ended = True
        self._changed.set()

    async def get(self) -> bytes | None:
        """The next chunk (possibly empty), or None once ended and drained."""
        while not self._chunks:
            if self._ended:
                return None
            self._changed.clear()
            await self._changed.wait()
        chunk = self._chunks.popleft()
        self._size -= len(chunk)
        self._changed.set()
        return chunk
