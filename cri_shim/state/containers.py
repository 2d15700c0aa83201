"""The containers' rows: written as a container's creation steps and lifecycle run."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.creation.coordinator import Phase
from cri_shim.state.objects import ObjectRepository, PhaseRow
from cri_shim.state.records import ContainerRecord

CREATED, RUNNING, EXITED = "created", "running", "exited"


class ContainerRepository(ObjectRepository[ContainerRecord]):
    table = "containers"
    kind = "container"

    def _record(self, row: sqlite3.Row) -> ContainerRecord:
        return ContainerRecord.from_row(row)

    def insert(
        self,
        container_id: str,
        name: str,
        sandbox_id: str,
        *,
        stage: str,
        image_id: str,
        image_ref: str,
        repo_digest: str,
        config: api_pb2.ContainerConfig,
        log_path: str,
        bundle_dir: Path,
        rootfs: Path,
        layers: list[str],
    ) -> None:
        """The row of a creation that is starting: in flight, created."""
        self._write(
            container_id,
            "INSERT INTO containers (id, name, sandbox_id, phase, stage, state, created_at, "
            "image_id, image_ref, repo_digest, config, log_path, bundle_dir, rootfs, "
            "layers) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                container_id,
                name,
                sandbox_id,
                Phase.IN_FLIGHT,
                stage,
                CREATED,
                time.time_ns(),
                image_id,
                image_ref,
                repo_digest,
                config.SerializeToString(),
                log_path,
                str(bundle_dir),
                str(rootfs),
                json.dumps(layers),
            ),
        )

    def add_layers(self, container_id: str, chains: Iterable[str]) -> None:
        """More layers the container's mounts stand on (its image volumes')."""
        with self._db.transaction() as conn:
            row = conn.execute(
                "SELECT layers FROM containers WHERE id = ?", (container_id,)
            ).fetchone()
            current = json.loads(row[0]) if row is not None else []
            merged = list(dict.fromkeys([*current, *chains]))
            conn.execute(
                "UPDATE containers SET layers = ? WHERE id = ?", (json.dumps(merged), container_id)
            )
        self._index.touch(container_id)

    def set_created(self, container_id: str, pid: int, process_user: dict[str, Any]) -> None:
        """The runtime made the container: its process and who that runs as."""
        self._write(
            container_id,
            "UPDATE containers SET pid = ?, process_user = ? WHERE id = ?",
            (pid, json.dumps(process_user, sort_keys=True), container_id),
        )

    def mark_running(self, container_id: str, started_at: int) -> None:
        self._write(
            container_id,
            "UPDATE containers SET state = ?, started_at = ? WHERE id = ?",
            (RUNNING, started_at, container_id),
        )

    def mark_exited(
        self,
        container_id: str,
        exit_code: int,
        finished_at: int,
        reason: str,
        message: str | None = None,
    ) -> bool:
        """True when this call changed it; an exit already recorded stays as it was.
        `message` says what the daemon knows of an exit it had to make up."""
        changed = self._write(
            container_id,
            "UPDATE containers SET state = ?, exit_code = ?, finished_at = ?, reason = ?, "
            "message = COALESCE(?, message) WHERE id = ? AND state != ?",
            (EXITED, exit_code, finished_at, reason, message, container_id, EXITED),
        )
        return changed > 0

    def sandbox_of(self, container_id: str) -> str | None:
        row = self._db.query_one("SELECT sandbox_id FROM containers WHERE id = ?", (container_id,))
        return str(row[0]) if row is not None else None

    def list_visible_in(self, sandbox_id: str) -> list[ContainerRecord]:
        return [c for c in self._index.current().values() if c.sandbox_id == sandbox_id]

    def cleaning_in(self, sandbox_id: str) -> list[PhaseRow]:
        """The sandbox's containers being torn down (removed, or rolled back)."""
        rows = self._db.query(
            "SELECT id, name, phase FROM containers WHERE phase = ? AND sandbox_id = ?",
            (Phase.CLEANING, sandbox_id),
        )
        return [PhaseRow(r["id"], r["name"], r["phase"]) for r in rows]

    def layers_in_use(self) -> set[str]:
        """Layers under some container's mounts (recorded at creation: the image itself may
        already be gone when the store asks)."""
        used: set[str] = set()
        for row in self._db.query("SELECT DISTINCT layers FROM containers"):
            used.update(json.loads(row[0]))
        return used
