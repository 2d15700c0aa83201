"""The C heap's trim, against this process's own glibc heap: memory freed in the middle of
the heap stays resident until a trim gives its pages back."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.host import heap
from tests.waiting import until

pytestmark = pytest.mark.skipif(heap.free_bytes() is None, reason="not glibc 2.33 or later")

BLOCK = 16 * 1024  # well under malloc's mmap threshold: from an arena, not an mmap
BLOCKS = 2048  # 32 MiB


def anonymous_rss() -> int:
    status = Path("/proc/self/status").read_text()
    line = next(line for line in status.splitlines() if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def freed_in_the_middle() -> Iterator[None]:
    """32 MiB written and freed below a block still in use, so that malloc cannot give
    it back by shrinking the heap from its top."""
    libc = ctypes.CDLL(None)  # its own handle: the daemon's declares no malloc
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    guard = libc.malloc(BLOCK)
    for block in blocks:
        libc.free(block)
    yield
    libc.free(guard)


def test_a_trim_gives_freed_pages_back(freed_in_the_middle: None) -> None:
    free = heap.free_bytes()
    assert free is not None and free >= BLOCK * BLOCKS
    resident = anonymous_rss()
    assert heap.HeapTrimmer(threshold=BLOCK * BLOCKS).step()
    assert anonymous_rss() < resident - BLOCK * BLOCKS // 2


def test_no_trim_below_the_threshold(freed_in_the_middle: None) -> None:
    free = heap.free_bytes()
    assert free is not None
    resident = anonymous_rss()
    assert not heap.HeapTrimmer(threshold=free + 1).step()
    assert anonymous_rss() > resident - BLOCK * BLOCKS // 2


def test_the_arenas_can_be_limited() -> None:
    assert heap.limit_arenas(heap.ARENAS)


async def test_a_large_free_is_trimmed_within_the_settle_not_the_interval(
    freed_in_the_middle: None,
) -> None:
    resident = anonymous_rss()
    trimmer = heap.HeapTrimmer(interval=3600, threshold=BLOCK * BLOCKS, settle=0.05)
    running = asyncio.create_task(trimmer.run())
    try:
        trimmer.freed(BLOCK)  # a small free: no trim before the interval
        await asyncio.sleep(0.3)
        assert anonymous_rss() > resident - BLOCK * BLOCKS // 2
        trimmer.freed(BLOCK * BLOCKS)
        await until(lambda: anonymous_rss() < resident - BLOCK * BLOCKS // 2, timeout=5)
    finally:
        running.cancel()
