"""Domain records read from the state database: typed views of rows, nothing more.

A sandbox's or container's record is the row as it was read, and frozen: a write to the
row is read into a new record (state/objects.py keeps the visible ones), so that what is
worked out from a record once (`derived`, the CRI items List and Status answer with) holds
for as long as the record does.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cri_shim.api.v1 import api_pb2
from cri_shim.pod_rules import host_network, pod_hostname

Value = TypeVar("Value")
Snapshot = TypeVar("Snapshot", bound="RowSnapshot")


@dataclass(frozen=True)
class RowSnapshot:
    """One row as read. `derived` works a value out of it once, keyed by the function
    that makes it: a List or Status call answers an unchanged object for the cost of a
    lookup, not of translating it again."""

    _derived: dict[Callable[[Any], Any], Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def derived(self: Snapshot, make: Callable[[Snapshot], Value]) -> Value:
        try:
            value: Value = self._derived[make]
        except KeyError:
            value = self._derived[make] = make(self)
        return value


@dataclass(frozen=True)
class SandboxRecord(RowSnapshot):
    id: str
    name: str
    phase: str
    stage: str
    state: str
    created_at: int
    runtime_handler: str
    config: api_pb2.PodSandboxConfig
    sandbox_dir: Path
    netns_path: Path | None
    ipc_path: Path | None
    uts_path: Path | None
    userns_path: Path | None
    ips: list[str]
    cni_result: dict[str, object] | None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> SandboxRecord:
        config = api_pb2.PodSandboxConfig()
        config.ParseFromString(row["config"])
        return cls(
            id=row["id"],
            name=row["name"],
            phase=row["phase"],
            stage=row["stage"],
            state=row["state"],
            created_at=int(row["created_at"]),
            runtime_handler=row["runtime_handler"],
            config=config,
            sandbox_dir=Path(row["sandbox_dir"]),
            netns_path=_path(row["netns_path"]),
            ipc_path=_path(row["ipc_path"]),
            uts_path=_path(row["uts_path"]),
            userns_path=_path(row["userns_path"]),
            ips=list(json.loads(row["ips"])),
            cni_result=json.loads(row["cni_result"]) if row["cni_result"] else None,
        )

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def host_network(self) -> bool:
        return host_network(self.config)

    @property
    def hostname(self) -> str:
        return pod_hostname(self.config, self.id)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


@dataclass(frozen=True)
class ContainerRecord(RowSnapshot):
    id: str
    name: str
    sandbox_id: str
    phase: str
    stage: str
    state: str  # created | running | exited | unknown
    created_at: int
    started_at: int
    finished_at: int
    exit_code: int
    reason: str
    message: str
    image_id: str
    image_ref: str  # the image as the user named it (a tag, or a digest reference)
    config: api_pb2.ContainerConfig
    log_path: str
    # The directories as stored; `bundle_dir` and `rootfs` make the paths when asked:
    # Path() costs more than the rest of a row, and a listing reads every row and
    # looks at neither.
    bundle_dir_raw: str
    rootfs_raw: str
    pid: int
    repo_digest: str = ""  # `name@sha256:…`, or "" for an image with no repository digest
    # The OCI spec's process.user as JSON; "" until the runtime has made the container
    # (and for containers made before the daemon recorded it).
    process_user: str = ""

    @property
    def bundle_dir(self) -> Path:
        return Path(self.bundle_dir_raw)

    @property
    def rootfs(self) -> Path:
        return Path(self.rootfs_raw)

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> ContainerRecord:
        config = api_pb2.ContainerConfig()
        config.ParseFromString(row["config"])
        return cls(
            id=row["id"],
            name=row["name"],
            sandbox_id=row["sandbox_id"],
            phase=row["phase"],
            stage=row["stage"],
            state=row["state"],
            created_at=int(row["created_at"]),
            started_at=int(row["started_at"]),
            finished_at=int(row["finished_at"]),
            exit_code=int(row["exit_code"]),
            reason=row["reason"],
            message=row["message"],
            image_id=row["image_id"],
            image_ref=row["image_ref"],
            repo_digest=row["repo_digest"],
            config=config,
            log_path=row["log_path"],
            bundle_dir_raw=row["bundle_dir"],
            rootfs_raw=row["rootfs"],
            pid=int(row["pid"]),
            process_user=row["process_user"],
        )


@dataclass
class ImageRecord:
    id: str  # sha256:<config digest>
    repo_tags: list[str]
    repo_digests: list[str]
    size: int
    config: dict[str, Any]
    layers: list[str]  # chain IDs, bottom first
    created_at: int  # nanoseconds since the epoch, when first stored
    manifest_digest: str = ""

    @property
    def _runtime_config(self) -> dict[str, Any]:
        value = self.config.get("config") or {}
        return value if isinstance(value, dict) else {}

    @property
    def user(self) -> str:
        return str(self._runtime_config.get("User") or "")

    @property
    def env(self) -> list[str]:
        return list(self._runtime_config.get("Env") or [])

    @property
    def entrypoint(self) -> list[str]:
        return list(self._runtime_config.get("Entrypoint") or [])

    @property
    def cmd(self) -> list[str]:
        return list(self._runtime_config.get("Cmd") or [])

    @property
    def working_dir(self) -> str:
        return str(self._runtime_config.get("WorkingDir") or "")

    @property
    def stop_signal(self) -> str:
        return str(self._runtime_config.get("StopSignal") or "")

    @property
    def volumes(self) -> list[str]:
        return sorted(self._runtime_config.get("Volumes") or {})

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._runtime_config.get("Labels") or {})

    @property
    def diff_ids(self) -> list[str]:
        rootfs = self.config.get("rootfs") or {}
        return list(rootfs.get("diff_ids") or [])


def image_from_row(row: sqlite3.Row) -> ImageRecord:
    return ImageRecord(
        id=row["id"],
        repo_tags=json.loads(row["repo_tags"]),
        repo_digests=json.loads(row["repo_digests"]),
        size=int(row["size"]),
        config=json.loads(row["config"]),
        layers=json.loads(row["layers"]),
        created_at=int(row["created_at"]),
        manifest_digest=row["manifest_digest"],
    )
