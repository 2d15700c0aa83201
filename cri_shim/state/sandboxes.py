"""The sandboxes' rows: written as a pod's creation steps run, read by every query."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.creation.coordinator import Phase
from cri_shim.state.objects import ObjectRepository
from cri_shim.state.records import SandboxRecord

READY, NOT_READY = "ready", "notready"


class SandboxRepository(ObjectRepository[SandboxRecord]):
    table = "sandboxes"
    kind = "sandbox"

    def _record(self, row: sqlite3.Row) -> SandboxRecord:
        return SandboxRecord.from_row(row)

    def insert(
        self,
        sandbox_id: str,
        name: str,
        stage: str,
        runtime_handler: str,
        config: api_pb2.PodSandboxConfig,
        sandbox_dir: Path,
    ) -> None:
        """The row of a creation that is starting: in flight, not ready."""
        self._write(
            sandbox_id,
            "INSERT INTO sandboxes (id, name, phase, stage, state, created_at, "
            "runtime_handler, config, sandbox_dir) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                sandbox_id,
                name,
                Phase.IN_FLIGHT,
                stage,
                NOT_READY,
                time.time_ns(),
                runtime_handler,
                config.SerializeToString(),
                str(sandbox_dir),
            ),
        )

    def set_namespaces(
        self,
        sandbox_id: str,
        *,
        net: Path | None,
        ipc: Path | None,
        uts: Path | None,
        user: Path | None,
    ) -> None:
        self._write(
            sandbox_id,
            "UPDATE sandboxes SET netns_path = ?, ipc_path = ?, uts_path = ?, userns_path = ? "
            "WHERE id = ?",
            (_str(net), _str(ipc), _str(uts), _str(user), sandbox_id),
        )

    def mark_ready(
        self, sandbox_id: str, ips: list[str], cni_result: dict[str, Any] | None
    ) -> None:
        """The pod's network is up (or it has none): its addresses, and ready."""
        self._write(
            sandbox_id,
            "UPDATE sandboxes SET ips = ?, cni_result = ?, state = ? WHERE id = ?",
            (json.dumps(ips), json.dumps(cni_result) if cni_result else None, READY, sandbox_id),
        )

    def mark_not_ready(self, sandbox_id: str) -> bool:
        """True when this call changed it (one event per transition)."""
        return (
            self._write(
                sandbox_id,
                "UPDATE sandboxes SET state = ? WHERE id = ? AND state != ?",
                (NOT_READY, sandbox_id, NOT_READY),
            )
            > 0
        )

    def runtime_handler(self, sandbox_id: str) -> str | None:
        row = self._db.query_one(
            "SELECT runtime_handler FROM sandboxes WHERE id = ?", (sandbox_id,)
        )
        return str(row[0]) if row is not None else None

    def pinned_paths(self) -> set[str]:
        """Every namespace pin some sandbox row names, whatever its phase."""
        rows = self._db.query("SELECT netns_path, ipc_path, uts_path, userns_path FROM sandboxes")
        return {str(value) for row in rows for value in row if value}


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None
