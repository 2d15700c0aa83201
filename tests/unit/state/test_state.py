"""State database: migrations, the undo journal and the allocation ledger."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cri_shim.state.db import Database
from cri_shim.state.journal import Journal, UndoFailed
from cri_shim.state.ledger import DoubleAllocation, Ledger
from cri_shim.state.schema import MIGRATIONS


def test_schema_is_migrated_once_and_uses_wal(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    assert db.schema_version == len(MIGRATIONS)
    db.execute("INSERT INTO names VALUES ('n', 'sandbox', 'id1', 0)")
    db.close()
    again = Database(tmp_path / "state.db")
    assert again.query_one("SELECT object_id FROM names WHERE name = 'n'")[0] == "id1"
    assert again.query_one("PRAGMA journal_mode")[0] == "wal"


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer than this cri-shim"):
        Database(tmp_path / "state.db")


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    with pytest.raises(ValueError), db.transaction() as conn:
        conn.execute("INSERT INTO names VALUES ('n', 'sandbox', 'id1', 0)")
        raise ValueError
    assert db.query("SELECT * FROM names") == []


class FakeHost:
    """Records undo calls; can be told to fail an action a number of times."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.failures: dict[str, int] = {}

    def action(self, name: str):  # type: ignore[no-untyped-def]
        async def run(args: dict[str, Any]) -> None:
            self.calls.append((name, args))
            if self.failures.get(name, 0) > 0:
                self.failures[name] -= 1
                raise OSError(f"{name} failed")

        return run


def _journal(tmp_path: Path, host: FakeHost) -> tuple[Database, Journal]:
    db = Database(tmp_path / "state.db")
    journal = Journal(
        db, {n: host.action(n) for n in ("a", "b", "c")}, attempts=3, first_backoff=0.001
    )
    return db, journal


async def test_journal_runs_backwards_and_forgets_done_steps(tmp_path: Path) -> None:
    host = FakeHost()
    _, journal = _journal(tmp_path, host)
    journal.record("obj", "a", n=1)
    journal.record("obj", "b", n=2)
    journal.record("obj", "c", n=3)
    await journal.undo("obj", keep=["a"])
    assert [c[0] for c in host.calls] == ["c", "b"]
    assert [s.action for s in journal.steps("obj")] == ["a"]
    await journal.undo("obj")
    assert journal.steps("obj") == []


def test_a_journal_batch_commits_its_steps_together(tmp_path: Path) -> None:
    db, journal = _journal(tmp_path, FakeHost())
    ledger = Ledger(db)
    other = sqlite3.connect(tmp_path / "state.db")  # what a restart after a crash reads
    commits: list[str] = []
    db._conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    with journal.batch():
        journal.record("obj", "a", n=1)
        ledger.allocate("path", "/run/netns/obj", "obj")
        journal.record("obj", "b", n=2)
        assert other.execute("SELECT COUNT(*) FROM journal").fetchone() == (0,)
    assert commits == ["COMMIT"]
    assert other.execute("SELECT action FROM journal ORDER BY seq").fetchall() == [("a",), ("b",)]
    with pytest.raises(DoubleAllocation), journal.batch():
        journal.record("obj2", "a", n=1)
        ledger.allocate("path", "/run/netns/obj", "obj2")
    assert journal.steps("obj2") == []  # none of a failed batch is kept
    other.close()


async def test_journal_retries_then_queues_for_gc(tmp_path: Path) -> None:
    host = FakeHost()
    db, journal = _journal(tmp_path, host)
    journal.record("obj", "a")
    journal.record("obj", "b")
    host.failures = {"b": 1, "a": 10}
    with pytest.raises(UndoFailed, match="a: a failed"):
        await journal.undo("obj")
    assert [c[0] for c in host.calls] == ["b", "b", "a", "a", "a"]
    # The object is done with; the failed step lives on in the GC queue.
    assert journal.steps("obj") == []
    assert db.query_one("SELECT action FROM gc_queue")[0] == "a"
    host.failures = {}
    assert await journal.collect_garbage() == 0


async def test_journal_respects_its_budget(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")

    async def hang(args: dict[str, Any]) -> None:
        await asyncio.sleep(60)

    journal = Journal(db, {"hang": hang})
    journal.record("obj", "hang")
    with pytest.raises(UndoFailed, match="budget"):
        await asyncio.wait_for(journal.undo("obj", budget=0.2), 5)


def test_unknown_actions_are_refused_when_recorded(tmp_path: Path) -> None:
    _, journal = _journal(tmp_path, FakeHost())
    with pytest.raises(KeyError):
        journal.record("obj", "nope")


def test_ledger_refuses_double_allocation(tmp_path: Path) -> None:
    ledger = Ledger(Database(tmp_path / "state.db"))
    ledger.allocate("ip", "10.0.0.2", "pod-a")
    ledger.allocate("ip", "10.0.0.2", "pod-a")  # idempotent for the same owner
    with pytest.raises(DoubleAllocation, match="pod-a"):
        ledger.allocate("ip", "10.0.0.2", "pod-b")
    ledger.release("pod-a", "ip")
    ledger.allocate("ip", "10.0.0.2", "pod-b")
    assert [(k, v) for k, v, owner in ledger.all() if owner == "pod-b"] == [("ip", "10.0.0.2")]
