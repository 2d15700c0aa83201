"""The allocation ledger (DESIGN §4): what was handed out, to whom, until its teardown ran.

Written synchronously at the moment something is handed out and released only after the
teardown step that frees it has finished. Nothing decides what is free from a status that
can lag (a process list, a CNI cache, a directory scan).
"""

from __future__ import annotations

import logging
import time

from cri_shim.state.db import Database

log = logging.getLogger("cri_shim.ledger")


class DoubleAllocation(Exception):
    """Something was handed out that a live owner still holds: a bug, never silently ignored."""


class Ledger:
    def __init__(self, db: Database) -> None:
        self._db = db

    def allocate(self, kind: str, value: str, owner_id: str) -> None:
        with self._db.transaction() as conn:
            row = conn.execute(
                "SELECT owner_id FROM allocations WHERE kind = ? AND value = ?", (kind, value)
            ).fetchone()
            if row is not None and row[0] != owner_id:
                raise DoubleAllocation(f"{kind} {value} is already held by {row[0]}")
            conn.execute(
                "INSERT OR IGNORE INTO allocations (kind, value, owner_id, allocated_at) "
                "VALUES (?, ?, ?, ?)",
                (kind, value, owner_id, time.time()),
            )

    def release(self, owner_id: str, kind: str | None = None) -> None:
        if kind is None:
            self._db.execute("DELETE FROM allocations WHERE owner_id = ?", (owner_id,))
        else:
            self._db.execute(
                "DELETE FROM allocations WHERE owner_id = ? AND kind = ?", (owner_id, kind)
            )

    def release_value(self, kind: str, value: str) -> None:
        """Whoever holds it: its teardown step has run."""
        self._db.execute("DELETE FROM allocations WHERE kind = ? AND value = ?", (kind, value))

    def all(self) -> list[tuple[str, str, str]]:
        rows = self._db.query("SELECT kind, value, owner_id FROM allocations ORDER BY kind, value")
        return [(r[0], r[1], r[2]) for r in rows]
