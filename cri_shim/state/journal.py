"""The undo journal (DESIGN §2): each creation step, once done, records its inverse here.

A failed creation, an expired cached object, a removal and a restart that finds an
interrupted creation all run the same rows backwards. Because the journal is rows in the
state database rather than closures in memory, a crash cannot forget what needs undoing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cri_shim import tracing
from cri_shim.faults import fault_point, undo_point
from cri_shim.state.db import Database

log = logging.getLogger("cri_shim.journal")

UndoAction = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class UndoStep:
    object_id: str
    seq: int
    action: str
    args: dict[str, Any]


class UndoFailed(Exception):
    """Some undo steps still failed after their retries; they were queued for GC."""

    def __init__(self, failures: list[tuple[UndoStep, str]]) -> None:
        self.failures = failures
        detail = "; ".join(f"{step.action}: {error}" for step, error in failures)
        super().__init__(f"{len(failures)} undo step(s) failed: {detail}")


class Journal:
    def __init__(
        self,
        db: Database,
        actions: dict[str, UndoAction] | None = None,
        *,
        attempts: int = 4,
        first_backoff: float = 0.2,
    ) -> None:
        self._db = db
        self._actions: dict[str, UndoAction] = dict(actions or {})
        self._attempts = attempts
        self._first_backoff = first_backoff

    def register(self, action: str, undo: UndoAction) -> None:
        self._actions[action] = undo

    def actions(self) -> frozenset[str]:
        """The undo actions registered, each a step the journal may record and run."""
        return frozenset(self._actions)

    def record(self, object_id: str, action: str, **args: Any) -> int:
        """Record the inverse of a step that is about to be (or was just) done; returns its seq."""
        if action not in self._actions:
            raise KeyError(f"no undo action named {action!r} is registered")
        with self._db.transaction() as conn:
            row = conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM journal WHERE object_id = ?", (object_id,)
            ).fetchone()
            seq = int(row[0])
            conn.execute(
                "INSERT INTO journal (object_id, seq, action, args) VALUES (?, ?, ?, ?)",
                (object_id, seq, action, json.dumps(args, sort_keys=True)),
            )
        return seq

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The steps recorded in the block, and every other row written in it, are
        committed together when it ends: one commit where each would have made its own.
        Nothing may be awaited inside (another task's writes would join the transaction);
        a side effect recorded here must come after the block."""
        with self._db.transaction():
            yield

    def amend(self, object_id: str, seq: int, **args: Any) -> None:
        """Add what a step learned while running (a CNI result) to its recorded inverse."""
        row = self._db.query_one(
            "SELECT args FROM journal WHERE object_id = ? AND seq = ?", (object_id, seq)
        )
        if row is None:
            return
        merged = {**json.loads(row[0]), **args}
        self._db.execute(
            "UPDATE journal SET args = ? WHERE object_id = ? AND seq = ?",
            (json.dumps(merged, sort_keys=True), object_id, seq),
        )

    def discharge(self, object_id: str, action: str) -> None:
        """Drop the object's `action` steps: what they would undo is someone else's now."""
        self._db.execute(
            "DELETE FROM journal WHERE object_id = ? AND action = ?", (object_id, action)
        )

    def steps(self, object_id: str) -> list[UndoStep]:
        rows = self._db.query(
            "SELECT object_id, seq, action, args FROM journal WHERE object_id = ? ORDER BY seq",
            (object_id,),
        )
        return [UndoStep(r[0], int(r[1]), r[2], json.loads(r[3])) for r in rows]

    def steps_named(self, action: str) -> list[UndoStep]:
        """Every object's steps of one action, in the order they were recorded."""
        rows = self._db.query(
            "SELECT object_id, seq, action, args FROM journal WHERE action = ? ORDER BY rowid",
            (action,),
        )
        return [UndoStep(r[0], int(r[1]), r[2], json.loads(r[3])) for r in rows]

    def objects(self) -> list[str]:
        return [r[0] for r in self._db.query("SELECT DISTINCT object_id FROM journal")]

    async def undo(
        self,
        object_id: str,
        *,
        only: Iterable[str] | None = None,
        keep: Iterable[str] = (),
        budget: float = 120.0,
    ) -> None:
        """Run the object's steps backwards; each step's row is deleted once it succeeded.

        `only` limits the run to some actions (StopPodSandbox tears down the network but
        keeps the sandbox directory); `keep` skips some. Each step is retried with
        backoff; a step that still fails is moved to the GC queue so that the object can
        be forgotten and its name released (DESIGN §2.8), and UndoFailed is raised.
        """
        wanted = set(only) if only is not None else None
        skipped = set(keep)
        failures: list[tuple[UndoStep, str]] = []
        deadline = time.monotonic() + budget
        for step in reversed(self.steps(object_id)):
            if (wanted is not None and step.action not in wanted) or step.action in skipped:
                continue
            fault_point(undo_point(step.action))
            with tracing.span(f"undo {step.action}", **{"cri.undo.action": step.action}) as span:
                error = await self._run_with_retries(step, deadline)
                if error is not None:
                    span.fail(error)
            if error is not None:
                failures.append((step, error))
                self._queue_for_gc(step, error)
            self._db.execute(
                "DELETE FROM journal WHERE object_id = ? AND seq = ?", (step.object_id, step.seq)
            )
        if failures:
            raise UndoFailed(failures)

    async def _run_with_retries(self, step: UndoStep, deadline: float) -> str | None:
        backoff = self._first_backoff
        error = "not attempted"
        for attempt in range(1, self._attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return f"cleanup budget spent ({error})"
            try:
                await asyncio.wait_for(self._actions[step.action](step.args), remaining)
                return None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every undo failure is retried, then queued
                error = str(exc) or type(exc).__name__
                log.warning(
                    "undo %s of %s failed (attempt %d/%d): %s",
                    step.action,
                    step.object_id,
                    attempt,
                    self._attempts,
                    error,
                )
            if attempt < self._attempts:
                await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff *= 2
        return error

    def _queue_for_gc(self, step: UndoStep, error: str) -> None:
        log.error(
            "undo %s of %s queued for garbage collection: %s", step.action, step.object_id, error
        )
        self._db.execute(
            "INSERT INTO gc_queue (object_id, action, args, error, queued_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (
                step.object_id,
                step.action,
                json.dumps(step.args, sort_keys=True),
                error,
                time.time(),
            ),
        )

    async def collect_garbage(self) -> int:
        """Retry queued steps once each; returns how many are still queued."""
        rows = self._db.query("SELECT id, object_id, action, args FROM gc_queue ORDER BY id")
        for row in rows:
            action = self._actions.get(row[2])
            try:
                if action is None:
                    raise KeyError(f"no undo action named {row[2]!r}")
                await action(json.loads(row[3]))
            except Exception as exc:
                self._db.execute(
                    "UPDATE gc_queue SET attempts = attempts + 1, error = ? WHERE id = ?",
                    (str(exc), row[0]),
                )
                continue
            log.info("garbage collection: %s of %s done", row[2], row[1])
            self._db.execute("DELETE FROM gc_queue WHERE id = ?", (row[0],))
        remaining = self._db.query_one("SELECT COUNT(*) FROM gc_queue")
        return int(remaining[0]) if remaining else 0
