"""The WAL is copied into the database by checkpoint() on a worker thread, never by a commit
on the event loop, and starts over once a checkpoint has copied it."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest

from cri_shim.state.db import PAGE_CACHE_KIB, WAL_SIZE_LIMIT, Database


def _wal(db: Database) -> int:
    return os.stat(f"{db.path}-wal").st_size


def _write(db: Database, rows: int) -> None:
    for _ in range(rows):
        with db.transaction() as conn:
            conn.execute("INSERT INTO scratch (v) VALUES (?)", (os.urandom(2000),))


def test_commits_leave_the_wal_to_the_checkpointer(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    try:
        db.execute("CREATE TABLE scratch (id INTEGER PRIMARY KEY, v BLOB)")
        # 3,000 rows of 2 KB: SQLite's own checkpoint, at every 1,000 pages, would have
        # held the WAL near 4 MiB.
        _write(db, 3000)
        assert _wal(db) > 1.5 * WAL_SIZE_LIMIT
        db.checkpoint()
        _write(db, 1)  # the first commit after a complete checkpoint starts the WAL over
        assert _wal(db) <= WAL_SIZE_LIMIT
        assert db.query_one("SELECT count(*) AS n FROM scratch")["n"] == 3001
    finally:
        db.close()


async def test_the_periodic_checkpoint_runs_only_after_writes(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    calls: list[int] = []
    real = db.checkpoint

    def counted() -> None:
        calls.append(1)
        real()

    db.checkpoint = counted  # type: ignore[method-assign]
    db.execute("CREATE TABLE scratch (id INTEGER PRIMARY KEY, v BLOB)")
    _write(db, 1)  # before it starts: left for the first write after
    task = asyncio.create_task(db.checkpoint_periodically(interval=0.05, idle_interval=0.05))
    try:
        await asyncio.sleep(0.3)
        assert calls == []
        _write(db, 1)
        await asyncio.sleep(0.3)
        after_write = len(calls)
        await asyncio.sleep(0.3)  # nothing written meanwhile
        assert after_write == 1 and len(calls) == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        db.close()


async def test_without_writes_the_checkpointer_looks_half_as_often_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = Database(tmp_path / "state.db")
    db.execute("CREATE TABLE scratch (id INTEGER PRIMARY KEY, v BLOB)")
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        waits.append(delay)
        await real_sleep(0)

    async def waited(count: int) -> None:
        while len(waits) < count:
            await real_sleep(0.001)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    task = asyncio.create_task(db.checkpoint_periodically(interval=1, idle_interval=8))
    try:
        await waited(6)
        assert waits[:6] == [1, 2, 4, 8, 8, 8]
        _write(db, 1)
        before = len(waits)
        await waited(before + 2)
        # The write is checkpointed at the next look, and the looks are frequent again.
        assert waits[before] == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        db.close()


def test_the_page_cache_stays_small_however_much_is_read(tmp_path: Path) -> None:
    # SQLite's own count of what it holds on the heap (the linked library, the one that
    # Python's sqlite3 uses); its default page cache would keep 2 MiB of these 6 MiB.
    memory_used = ctypes.CDLL(ctypes.util.find_library("sqlite3")).sqlite3_memory_used
    memory_used.restype = ctypes.c_int64
    db = Database(tmp_path / "state.db")
    try:
        before = memory_used()
        db.execute("CREATE TABLE scratch (id INTEGER PRIMARY KEY, v BLOB)")
        _write(db, 3000)
        assert len(db.query("SELECT v FROM scratch")) == 3000
        assert memory_used() - before < (PAGE_CACHE_KIB << 10) + (512 << 10)
    finally:
        db.close()
