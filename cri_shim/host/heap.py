"""The C heap (glibc's malloc): few arenas, and its free pages given back to the kernel.

Python's small objects live in its own arenas, but everything bigger (gRPC's messages and
buffers, protobuf's, SQLite's pages, JSON text) comes from malloc. glibc gives a thread
that contends for an arena an arena of its own (up to eight per core), and returns freed
memory to the kernel only from the top of the heap: after a burst of pod creations the
daemon keeps megabytes that are free in malloc's eyes but resident in the kernel's
(benchmarks/critest_memory.py shows them). Where the C library is not glibc (musl), both
are skipped: each call is looked up, and a missing one does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

from cri_shim.host.libc import libc

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # mallopt's parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
ARENAS = 2  # the loop's thread and one shared by gRPC's and the worker threads
TRIM_INTERVAL = 30.0  # seconds
TRIM_THRESHOLD = 1024 * 1024  # free bytes in malloc's arenas worth a trim
TRIM_SETTLE = 0.2  # seconds from a large free to its trim
# Blocks this big or bigger are mapped on their own and unmapped when freed.
MMAP_THRESHOLD = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",  # free bytes in the arenas: what a trim may give back
            "keepcost",
        )
    ]


_mallopt = getattr(libc, "mallopt", None)
_mallinfo2 = getattr(libc, "mallinfo2", None)  # glibc 2.33 and later
_malloc_trim = getattr(libc, "malloc_trim", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _Mallinfo2
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]


def limit_arenas(count: int = ARENAS) -> bool:
    """At most `count` malloc arenas from now on; False where that cannot be set."""
    return _mallopt is not None and _mallopt(M_ARENA_MAX, count) == 1


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Blocks of `threshold` bytes or more mapped on their own from now on, and so given
    back to the kernel as soon as they are freed; False where that cannot be set. glibc
    maps blocks over 128 KiB so at first, but raises that bar to the size of each mapped
    block freed (up to 32 MiB): after the first reply of megabytes, the next ones (their
    serialization, gRPC core's copy) come from the heap, and a burst of them leaves the
    heap that much bigger until a trim, or for good where live blocks lie above them.
    Setting the threshold keeps it where it is set."""
    return _mallopt is not None and _mallopt(M_MMAP_THRESHOLD, threshold) == 1


def free_bytes() -> int | None:
    """Bytes free in malloc's arenas (all of them), None where glibc cannot tell."""
    if _mallinfo2 is None:
        return None
    return int(_mallinfo2().fordblks)


def trim() -> None:
    """Give every whole free page of every arena back to the kernel (malloc_trim(0))."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class HeapTrimmer:
    """Trims the heap every `interval` seconds when at least `threshold` bytes are free:
    an idle daemon's heap changes little, and a trim costs a walk of every arena. Told
    that a large buffer was freed (`freed`), it trims within `settle` seconds instead:
    replies of megabytes that waited for their clients (server/limits.py) would otherwise
    stay resident until the next round."""

    def __init__(
        self,
        interval: float = TRIM_INTERVAL,
        threshold: int = TRIM_THRESHOLD,
        settle: float = TRIM_SETTLE,
    ) -> None:
        self.interval = interval
        self.threshold = threshold
        self.settle = settle
        self._freed = asyncio.Event()

    def freed(self, size: int) -> None:
        """`size` bytes were just given back to malloc."""
        if size >= self.threshold:
            self._freed.set()

    def step(self) -> bool:
        """One look at the heap, trimmed if it holds enough free memory; whether it was."""
        free = free_bytes()
        if free is None or free < self.threshold:
            return False
        trim()
        return True

    async def run(self) -> None:
        if free_bytes() is None:
            log.debug("the C library reports no free heap memory: the heap is not trimmed")
            return
        while True:
            try:
                async with asyncio.timeout(self.interval):
                    await self._freed.wait()
                # Buffers freed together (calls ended by one deadline) make one trim.
                await asyncio.sleep(self.settle)
            except TimeoutError:
                pass
            self._freed.clear()
            self.step()
