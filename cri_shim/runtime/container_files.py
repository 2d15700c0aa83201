"""A runtime handler's containers as files under its `state_dir`.

conmon outlives the daemon, so a restart loses nothing: every fact the backend needs is a
file here, and nothing is kept in memory. Layout:

    state_dir/exits/<id>                      exit code written by conmon; mtime = finish time
    state_dir/sockets/                        attach-socket links of earlier versions
    state_dir/runc-logs/                      per-call runc logs (removed after each call)
    state_dir/containers/<id>/meta.json       bundle, log path, cgroup, conmon's identity
    state_dir/containers/<id>/conmon.pid      written by conmon
    state_dir/containers/<id>/conmon.log      conmon's own diagnostics
    state_dir/containers/<id>/persist/        conmon's persist dir (its `oom` marker)
    state_dir/containers/<id>/monitor-died    conmon died without recording an exit
    state_dir/containers/<id>/oom-killed      the OOM killer killed a process of it
                                              (cgroup v2: written by oom_watch.py)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from cri_shim.errors import FailedPrecondition
from cri_shim.runtime.monitors import ProcessRef, process_stat

_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass(frozen=True)
class Meta:
    bundle: str
    log_path: str
    cgroups_path: str
    conmon_pid: int = 0
    conmon_start_time: int = 0


class ContainerFiles:
    """Where a handler's containers' files are, and the reading of them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.exits = state_dir / "exits"
        self.sockets = state_dir / "sockets"
        self.containers = state_dir / "containers"

    def read_meta(self, container_id: str) -> Meta | None:
        try:
            raw = json.loads((self.containers / container_id / "meta.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return Meta(**raw)

    def conmon_ref(self, container_id: str) -> ProcessRef | None:
        meta = self.read_meta(container_id)
        if meta is None or meta.conmon_pid <= 0:
            return None
        return ProcessRef(meta.conmon_pid, meta.conmon_start_time)


def read_conmon_ref(cdir: Path) -> ProcessRef | None:
    """conmon's identity from the pid file it wrote in `cdir` (None: none, or it is gone)."""
    try:
        pid = int((cdir / "conmon.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    start = process_stat(pid)
    return ProcessRef(pid, start[2]) if start is not None else None


def check_id(container_id: str) -> None:
    # The id becomes a file name in several directories; refuse anything that could escape.
    if not _CONTAINER_ID.match(container_id):
        raise FailedPrecondition(f"invalid container id {container_id!r}")


def tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return "no diagnostics"
    return text[-limit:] or "no diagnostics"


def write_atomic(path: Path, data: bytes) -> None:
    """Written 0600: the spec holds the container's environment, which carries secrets."""
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(temporary, path)
