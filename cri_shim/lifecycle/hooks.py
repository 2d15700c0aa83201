"""The creation coordinator's persistence hooks, shared by sandboxes and containers.

Each hook writes the state database in the same step as the coordinator's in-memory
change, so that a restart finds reservations, stages and cached objects as they were.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time

from cri_shim.creation.coordinator import CreationCoordinator
from cri_shim.errors import InvalidArgument
from cri_shim.logcontext import object_bound
from cri_shim.state.db import Database
from cri_shim.state.journal import Journal, UndoFailed

log = logging.getLogger("cri_shim.restore")


class PersistedCreationHooks:
    """Rows for one kind of object: `names` for reservations, `table` for the object."""

    table: str
    kind: str
    # Set by the subclass: the coordinator these hooks serve and the journal it undoes.
    coordinator: CreationCoordinator
    _journal: Journal
    _cleanup_budget: float

    def __init__(self, db: Database) -> None:
        self._db = db

    def reserve(self, name: str, object_id: str) -> None:
        self._db.execute(
            "INSERT INTO names (name, kind, object_id, reserved_at) VALUES (?, ?, ?, ?)",
            (name, self.kind, object_id, time.time()),
        )

    def stage_changed(self, object_id: str, stage: str) -> None:
        # Before the first step the row does not exist yet; the stage is then in memory only.
        self._db.execute(f"UPDATE {self.table} SET stage = ? WHERE id = ?", (stage, object_id))

    def cached(self, object_id: str, expires_at: float) -> None:
        self._db.execute(
            f"UPDATE {self.table} SET phase = 'cached', cached_until = ? WHERE id = ?",
            (_wall_clock(expires_at), object_id),
        )

    def publish(self, object_id: str) -> None:
        self._db.execute(
            f"UPDATE {self.table} SET phase = 'visible', cached_until = NULL WHERE id = ?",
            (object_id,),
        )

    def mark_cleaning(self, object_id: str) -> None:
        """Before a cleanup's first await: a crash from here on must roll the object
        back at restart, never restore a half-undone object as claimable."""
        self._db.execute(f"UPDATE {self.table} SET phase = 'cleaning' WHERE id = ?", (object_id,))

    def released(self, name: str, object_id: str) -> None:
        self._db.execute("DELETE FROM names WHERE name = ? AND object_id = ?", (name, object_id))

    def forget(self, object_id: str) -> None:
        """Drop the object's rows once its teardown has run."""
        with self._db.transaction() as conn:
            conn.execute(f"DELETE FROM {self.table} WHERE id = ?", (object_id,))
            conn.execute("DELETE FROM names WHERE object_id = ?", (object_id,))
            conn.execute("DELETE FROM allocations WHERE owner_id = ?", (object_id,))

    def find_visible_row(self, ref: str) -> sqlite3.Row | None:
        """A visible object by full ID or unique ID prefix, as crictl users expect."""
        if not ref:
            raise InvalidArgument(f"{self.kind} ID must not be empty")
        escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        rows = self._db.query(
            f"SELECT * FROM {self.table} WHERE phase = 'visible' AND id LIKE ? ESCAPE '\\' LIMIT 2",
            (escaped + "%",),
        )
        if len(rows) > 1:
            rows = [r for r in rows if r["id"] == ref]
            if not rows:
                raise InvalidArgument(f"{self.kind} ID prefix {ref!r} is ambiguous")
        return rows[0] if rows else None

    async def restore_rows(self) -> None:
        """Before serving: roll back what a crash interrupted (a creation, or a cleanup),
        hand cached objects back to the coordinator with a fresh expiry, re-register the
        visible ones, and drop reservations that never got a row."""
        for row in self._db.query(f"SELECT id, name, phase FROM {self.table}"):
            with object_bound(self.kind, row["id"], row["name"]):
                if row["phase"] == "cached":
                    expires_at = self.coordinator.restore_cached(row["name"], row["id"])
                    self._db.execute(
                        f"UPDATE {self.table} SET cached_until = ? WHERE id = ?",
                        (_wall_clock(expires_at), row["id"]),
                    )
                elif row["phase"] == "visible":
                    self.coordinator.restore_visible(row["name"], row["id"])
                else:
                    log.warning(
                        "%s %s (%s): %s was interrupted; rolling it back",
                        self.kind,
                        row["id"],
                        row["name"],
                        row["phase"],
                    )
                    try:
                        await self._journal.undo(row["id"], budget=self._cleanup_budget)
                    except UndoFailed as exc:
                        log.error("%s %s: rollback left work for GC: %s", self.kind, row["id"], exc)
                    self.forget(row["id"])
        # A name reserved just before a crash, with no row yet: nothing was done for it.
        self._db.execute(
            f"DELETE FROM names WHERE kind = ? AND object_id NOT IN (SELECT id FROM {self.table})",
            (self.kind,),
        )


def _wall_clock(expires_at: float) -> float:
    """The coordinator's clock is the loop's; rows keep wall-clock time for humans."""
    return time.time() + max(0.0, expires_at - asyncio.get_running_loop().time())
