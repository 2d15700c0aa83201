"""Rows shared by every created object: its name's reservation and its creation phase.

A sandbox and a container go through the same phases as the creation coordinator holds
them in (`creation.coordinator.Phase`), and the rows use the coordinator's words for them,
so that what a restart reads back is what the coordinator had in memory.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from cri_shim.creation.coordinator import Phase
from cri_shim.errors import InvalidArgument
from cri_shim.state.db import Database

Record = TypeVar("Record")


@dataclass(frozen=True)
class PhaseRow:
    """What restore needs to decide an object's fate."""

    id: str
    name: str
    phase: str


class ObjectRepository(Generic[Record]):
    """The `names` rows of one kind of object and the phase columns of its own table."""

    table: str
    kind: str

    def __init__(self, db: Database) -> None:
        self._db = db

    def _record(self, row: sqlite3.Row) -> Record:
        raise NotImplementedError

    # ---- the coordinator's decisions ----------------------------------------------

    def reserve_name(self, name: str, object_id: str) -> None:
        self._db.execute(
            "INSERT INTO names (name, kind, object_id, reserved_at) VALUES (?, ?, ?, ?)",
            (name, self.kind, object_id, time.time()),
        )

    def release_name(self, name: str, object_id: str) -> None:
        self._db.execute("DELETE FROM names WHERE name = ? AND object_id = ?", (name, object_id))

    def set_stage(self, object_id: str, stage: str) -> None:
        # Before the first step the row does not exist yet; the stage is then in memory only.
        self._db.execute(f"UPDATE {self.table} SET stage = ? WHERE id = ?", (stage, object_id))

    def mark_cached(self, object_id: str, until: float) -> None:
        """Finished and unclaimed until `until` (wall-clock time)."""
        self._db.execute(
            f"UPDATE {self.table} SET phase = ?, cached_until = ? WHERE id = ?",
            (Phase.CACHED, until, object_id),
        )

    def extend_cached(self, object_id: str, until: float) -> None:
        self._db.execute(
            f"UPDATE {self.table} SET cached_until = ? WHERE id = ?", (until, object_id)
        )

    def mark_visible(self, object_id: str) -> None:
        self._db.execute(
            f"UPDATE {self.table} SET phase = ?, cached_until = NULL WHERE id = ?",
            (Phase.VISIBLE, object_id),
        )

    def mark_cleaning(self, object_id: str) -> None:
        self._db.execute(
            f"UPDATE {self.table} SET phase = ? WHERE id = ?", (Phase.CLEANING, object_id)
        )

    def forget(self, object_id: str) -> None:
        """The object's row, its name and what the ledger holds for it, in one step."""
        with self._db.transaction() as conn:
            conn.execute(f"DELETE FROM {self.table} WHERE id = ?", (object_id,))
            conn.execute("DELETE FROM names WHERE object_id = ?", (object_id,))
            conn.execute("DELETE FROM allocations WHERE owner_id = ?", (object_id,))

    # ---- restore ------------------------------------------------------------------

    def phases(self) -> list[PhaseRow]:
        rows = self._db.query(f"SELECT id, name, phase FROM {self.table}")
        return [PhaseRow(r["id"], r["name"], r["phase"]) for r in rows]

    def drop_names_without_rows(self) -> None:
        """A name reserved just before a crash, with no row yet: nothing was done for it."""
        self._db.execute(
            f"DELETE FROM names WHERE kind = ? AND object_id NOT IN (SELECT id FROM {self.table})",
            (self.kind,),
        )

    def ids(self) -> set[str]:
        """Every object of this kind with a row, whatever its phase."""
        return {str(row[0]) for row in self._db.query(f"SELECT id FROM {self.table}")}

    # ---- visible objects ----------------------------------------------------------

    def find_visible(self, ref: str) -> Record | None:
        """A visible object by full ID or unique ID prefix, as crictl users expect."""
        if not ref:
            raise InvalidArgument(f"{self.kind} ID must not be empty")
        # Clients send full IDs: the primary key finds those; a prefix is a range scan.
        exact = self.visible(ref)
        if exact is not None:
            return exact
        escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        rows = self._db.query(
            f"SELECT * FROM {self.table} WHERE phase = ? AND id LIKE ? ESCAPE '\\' LIMIT 2",
            (Phase.VISIBLE, escaped + "%"),
        )
        if len(rows) > 1:
            rows = [r for r in rows if r["id"] == ref]
            if not rows:
                raise InvalidArgument(f"{self.kind} ID prefix {ref!r} is ambiguous")
        return self._record(rows[0]) if rows else None

    def visible(self, object_id: str) -> Record | None:
        """The object with exactly this ID, if it is visible."""
        row = self._db.query_one(
            f"SELECT * FROM {self.table} WHERE id = ? AND phase = ?", (object_id, Phase.VISIBLE)
        )
        return self._record(row) if row is not None else None

    def list_visible(self) -> list[Record]:
        rows = self._db.query(
            f"SELECT * FROM {self.table} WHERE phase = ? ORDER BY created_at", (Phase.VISIBLE,)
        )
        return list(self._records(rows))

    def _records(self, rows: list[sqlite3.Row]) -> Iterator[Record]:
        return (self._record(row) for row in rows)
