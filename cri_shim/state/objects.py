"""Rows shared by every created object: its name's reservation and its creation phase.

A sandbox and a container go through the same phases as the creation coordinator holds
them in (`creation.coordinator.Phase`), and the rows use the coordinator's words for them,
so that what a restart reads back is what the coordinator had in memory.

The visible objects are also held in memory (`VisibleIndex`), the index DESIGN 1 allows
beside the rows: List and Status, which kubelet calls every second for every pod, read
that rather than decoding every row again. Each write to a row goes through the
repository, which touches the object in the index in the same step; the next read takes
that one row again from the database, so the rows stay the one source of truth and a
change shows in the very next List or Status. Only the daemon writes these tables (other
processes write images), and only from the event loop thread, as the connection's users
do.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from cri_shim.creation.coordinator import Phase
from cri_shim.errors import InvalidArgument
from cri_shim.state.db import Database


class ObjectRecord(Protocol):
    """What the index needs of a sandbox's or a container's record."""

    @property
    def id(self) -> str: ...
    @property
    def created_at(self) -> int: ...


Record = TypeVar("Record", bound=ObjectRecord)

# Touched objects beyond this many more than the index holds (a daemon that writes and is
# not asked for long): the index is dropped and read whole at the next read instead.
_TOUCHED_SLACK = 256


class VisibleIndex(Generic[Record]):
    """The visible objects of one table, by ID in creation order: read whole at the first
    read, then row by row for the objects written since (`touch`). Records are frozen: a
    row written is read into a new record, whatever was derived from the old one goes
    with it, and an object no longer visible leaves the index."""

    def __init__(self, db: Database, table: str, record: Callable[[sqlite3.Row], Record]) -> None:
        self._db = db
        self._table = table
        self._record = record
        self._objects: dict[str, Record] | None = None  # None: not read yet
        self._touched: set[str] = set()

    def touch(self, object_id: str) -> None:
        """The object's row was written: read it again before answering with it."""
        if self._objects is None:
            return
        self._touched.add(object_id)
        if len(self._touched) > len(self._objects) + _TOUCHED_SLACK:
            self._objects = None
            self._touched.clear()

    def current(self) -> dict[str, Record]:
        """The visible objects as the rows say now. Callers must not change it."""
        objects = self._objects
        if objects is None:
            rows = self._db.query(
                f"SELECT * FROM {self._table} WHERE phase = ? ORDER BY created_at",
                (Phase.VISIBLE,),
            )
            self._objects = objects = {row["id"]: self._record(row) for row in rows}
            self._touched.clear()
            return objects
        added = False
        # One at a time, each forgotten only once read: a read that fails leaves the
        # rest touched for the next one.
        for object_id in list(self._touched):
            row = self._db.query_one(
                f"SELECT * FROM {self._table} WHERE id = ? AND phase = ?",
                (object_id, Phase.VISIBLE),
            )
            if row is None:
                objects.pop(object_id, None)
            else:
                added = added or object_id not in objects
                objects[object_id] = self._record(row)
            self._touched.discard(object_id)
        if added:  # creation order, as the rows are listed
            ordered = sorted(objects.values(), key=lambda record: record.created_at)
            self._objects = objects = {record.id: record for record in ordered}
        return objects


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
        self._index = VisibleIndex(db, self.table, self._record)

    def _record(self, row: sqlite3.Row) -> Record:
        raise NotImplementedError

    def _write(self, object_id: str, sql: str, params: tuple[Any, ...]) -> int:
        """One statement that changes the object's row, and the index told in the same
        step (whatever became of the statement: the next read asks the row); the count of
        rows changed."""
        try:
            return self._db.execute(sql, params)
        finally:
            self._index.touch(object_id)

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
        self._write(
            object_id, f"UPDATE {self.table} SET stage = ? WHERE id = ?", (stage, object_id)
        )

    def mark_cached(self, object_id: str, until: float) -> None:
        """Finished and unclaimed until `until` (wall-clock time)."""
        self._write(
            object_id,
            f"UPDATE {self.table} SET phase = ?, cached_until = ? WHERE id = ?",
            (Phase.CACHED, until, object_id),
        )

    def extend_cached(self, object_id: str, until: float) -> None:
        self._write(
            object_id, f"UPDATE {self.table} SET cached_until = ? WHERE id = ?", (until, object_id)
        )

    def mark_visible(self, object_id: str) -> None:
        self._write(
            object_id,
            f"UPDATE {self.table} SET phase = ?, cached_until = NULL WHERE id = ?",
            (Phase.VISIBLE, object_id),
        )

    def mark_cleaning(self, object_id: str) -> None:
        self._write(
            object_id,
            f"UPDATE {self.table} SET phase = ? WHERE id = ?",
            (Phase.CLEANING, object_id),
        )

    def forget(self, object_id: str) -> None:
        """The object's row, its name and what the ledger holds for it, in one step."""
        with self._db.transaction() as conn:
            conn.execute(f"DELETE FROM {self.table} WHERE id = ?", (object_id,))
            conn.execute("DELETE FROM names WHERE object_id = ?", (object_id,))
            conn.execute("DELETE FROM allocations WHERE owner_id = ?", (object_id,))
        self._index.touch(object_id)

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
        objects = self._index.current()
        # Clients send full IDs: a lookup finds those; a prefix scans the visible IDs,
        # ASCII case aside, as SQL's LIKE compared them.
        exact = objects.get(ref)
        if exact is not None:
            return exact
        prefix = ref.lower()
        found = [
            record for object_id, record in objects.items() if object_id.lower().startswith(prefix)
        ]
        if len(found) > 1:
            raise InvalidArgument(f"{self.kind} ID prefix {ref!r} is ambiguous")
        return found[0] if found else None

    def visible(self, object_id: str) -> Record | None:
        """The object with exactly this ID, if it is visible."""
        return self._index.current().get(object_id)

    def list_visible(self) -> list[Record]:
        """The visible objects, oldest first."""
        return list(self._index.current().values())
