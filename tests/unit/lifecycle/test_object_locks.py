"""ObjectLocks: one holder per object at a time, and nothing kept once all have left."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cri_shim.lifecycle.object_locks import ObjectLocks


async def test_a_second_holder_of_one_object_waits_for_the_first() -> None:
    locks = ObjectLocks()
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with locks.held("a"):
            order.append("first in")
            await release.wait()
            order.append("first out")

    async def second() -> None:
        async with locks.held("a"):
            order.append("second in")

    tasks = [asyncio.create_task(first())]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(second()))
    await asyncio.sleep(0)
    assert order == ["first in"]
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["first in", "first out", "second in"]
    assert len(locks) == 0


async def test_other_objects_do_not_wait() -> None:
    locks = ObjectLocks()
    async with locks.held("a"):
        async with locks.held("b"):
            assert len(locks) == 2
    assert len(locks) == 0


async def test_a_waiter_that_is_cancelled_leaves_nothing_behind() -> None:
    locks = ObjectLocks()
    async with locks.held("a"):

        async def waiter() -> None:
            async with locks.held("a"):
                raise AssertionError("entered while the lock was held")

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(locks) == 0


async def test_current_reads_the_object_again_once_the_lock_is_held() -> None:
    """A second caller waits for the first, then sees what the first left: here, nothing."""
    locks = ObjectLocks()
    objects = {"abc123": SimpleNamespace(id="abc123")}
    seen: list[object] = []
    first_holds = asyncio.Event()

    async def first() -> None:
        async with locks.current(objects.get, "abc123") as found:
            first_holds.set()
            await asyncio.sleep(0)
            seen.append(found)
            del objects["abc123"]  # removed by the first caller

    async def second() -> None:
        await first_holds.wait()
        async with locks.current(objects.get, "abc123") as found:
            seen.append(found)

    await asyncio.gather(first(), second())
    assert seen[0] is not None and seen[1] is None
    async with locks.current(objects.get, "gone") as absent:
        assert absent is None
    assert len(locks) == 0
