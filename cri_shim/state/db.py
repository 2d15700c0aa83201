"""The state database: one SQLite file (WAL) under the state root, the single source of truth.

Rows are written before the side effect they describe, so that a crash leaves a record of
everything that may need undoing. The connection is used from the event loop thread; each
statement is short, and WAL lets `cri-shim images import` write from another process.

Commits do not checkpoint (copy the WAL into the database and fsync it): on a busy disk
that takes tens of milliseconds, which every call the event loop serves would wait. The
daemon runs checkpoint() on a worker thread instead, through a connection of its own, which
a passive checkpoint lets the loop's writes go on beside.

The file is 0600 (SQLite gives its -wal and -shm files the same mode): rows hold
container environments, which carry secrets. A damaged file stops the start with one
line that says which file and what to do (`DamagedDatabase`), rather than a traceback
that a service manager would restart for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cri_shim.state.schema import MIGRATIONS

# Once a checkpoint has copied it all, the WAL starts over and is cut back to this.
WAL_SIZE_LIMIT = 4 << 20
CHECKPOINT_INTERVAL = 1.0
# The longest between two looks for writes to checkpoint (a write waits at most this long).
CHECKPOINT_IDLE_INTERVAL = 8.0
# SQLite's page cache, allocated on the daemon's heap. Its default (2000 KiB) fills with
# the pages restore and writes touch: about 1 MiB with 110 pods held, all of it kept.
# Lists and statuses are answered from memory; a write touches a few B-tree pages, and a
# page not cached is read from the OS's page cache (the WAL index says where) in
# microseconds. A quarter of a MiB holds the pages that writes keep touching.
PAGE_CACHE_KIB = 256


class DamagedDatabase(Exception):
    """The state database cannot be read; the message says which file and what to do."""


class Database:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        os.chmod(path, 0o600)  # a file made by an older version, or by hand
        self._conn = sqlite3.connect(
            str(path), isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._checkpoint_lock = threading.Lock()
        try:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.execute("PRAGMA busy_timeout=30000")
            self._conn.execute("PRAGMA wal_autocheckpoint=0")
            self._conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self._conn.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")  # negative: KiB
            problems = [row[0] for row in self._conn.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
            self._migrate()
        except sqlite3.DatabaseError as err:
            self._conn.close()
            if isinstance(err, sqlite3.OperationalError) and "locked" in str(err):
                raise
            raise DamagedDatabase(
                f"state database {path} is damaged ({err}). Stop cri-shim, move {path} "
                f"(and {path.name}-wal, {path.name}-shm beside it) aside, then either put a "
                "backup in its place or start with an empty state: running containers are "
                "then found as orphans and removed"
            ) from None

    @property
    def schema_version(self) -> int:
        return int(self._conn.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self.transaction():
            version = self.schema_version
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"state database {self.path} has schema version {version}, newer than this "
                    f"cri-shim understands ({len(MIGRATIONS)}); upgrade cri-shim"
                )
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in script.split(";"):
                    if statement.strip():
                        self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version = {number}")

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic step; nested calls join the outer transaction."""
        with self._lock:
            if self._conn.in_transaction:
                yield self._conn
                return
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                # SQLite rolls some failures back itself (a full disk): then there is
                # nothing left to roll back, and the original error is the one to report.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def execute(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> int:
        with self._lock:
            return self._conn.execute(sql, params).rowcount

    def query(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def query_one(
        self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()
    ) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._conn.execute(sql, params).fetchone()
            return row

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database (a passive checkpoint: writers go on
        meanwhile). Blocking: call it off the event loop, as checkpoint_periodically()
        does. Through a connection opened for it and closed after, which an idle daemon
        does not keep (it costs half a MiB)."""
        with self._checkpoint_lock:
            checkpointer = sqlite3.connect(str(self.path), isolation_level=None)
            try:
                checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            finally:
                checkpointer.close()

    async def checkpoint_periodically(
        self, interval: float = CHECKPOINT_INTERVAL, idle_interval: float = CHECKPOINT_IDLE_INTERVAL
    ) -> None:
        """checkpoint() on a worker thread every `interval` seconds in which something was
        written; cancel to stop. Own it in the daemon's task group.

        Without writes it looks twice as long apart each time, up to `idle_interval`: an
        idle daemon (and a node whose pods just run, which writes nothing) need not wake
        every second, and the WAL holds nothing to copy then."""
        # From the writes after it starts: the start's own (migrations, restore) wait for
        # the first of those, so that a daemon that serves and writes nothing never opens
        # a second connection.
        checkpointed = self._conn.total_changes
        wait = interval
        while True:
            await asyncio.sleep(wait)
            changes = self._conn.total_changes
            if changes != checkpointed:
                checkpointed = changes
                wait = interval
                await asyncio.to_thread(self.checkpoint)
            else:
                wait = min(wait * 2, idle_interval)

    def close(self) -> None:
        """Checkpoint what is left (a process that only imported images has no periodic
        checkpoint) and close."""
        with self._checkpoint_lock, self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self._conn.close()
