"""The state database when the disk is full or the file is damaged, and its file mode."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from cri_shim.state.db import DamagedDatabase, Database


def test_a_full_disk_reports_its_own_error_not_a_failed_rollback(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    # SQLite rolls the whole transaction back itself when the database cannot grow.
    db.execute(f"PRAGMA max_page_count = {db.query_one('PRAGMA page_count')[0] + 2}")
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        with db.transaction() as conn:
            for index in range(200):
                conn.execute(
                    "INSERT INTO names (name, kind, object_id, reserved_at) VALUES (?, ?, ?, 0)",
                    (f"name-{index}", "sandbox", f"{index}-" + "x" * 4000),
                )
    # Nothing of it was kept, and the connection goes on working.
    assert db.query("SELECT * FROM names") == []
    with db.transaction() as conn:
        conn.execute("SELECT 1")
    db.close()


@pytest.mark.parametrize(
    "content",
    [b"this is not a database at all" * 100, b"SQLite format 3\x00" + b"\xff" * 4080],
)
def test_a_damaged_file_names_itself_and_what_to_do(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(content)
    with pytest.raises(DamagedDatabase) as caught:
        Database(path)
    message = str(caught.value)
    assert str(path) in message and "move" in message and "backup" in message
    assert "\n" not in message


def test_the_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch(mode=0o644)
    db = Database(path)
    db.execute("INSERT INTO names (name, kind, object_id, reserved_at) VALUES ('a', 's', 'i', 0)")
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    db.close()
