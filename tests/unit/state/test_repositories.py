"""The sandbox and container repositories, and the schema's phase vocabulary."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.creation.coordinator import Phase
from cri_shim.errors import InvalidArgument
from cri_shim.state.containers import EXITED, ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.ledger import Ledger
from cri_shim.state.sandboxes import SandboxRepository
from cri_shim.state.schema import MIGRATIONS
from tests.unit.state.row_fixtures import add_container


def _pod() -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name="web", namespace="default", uid="u1")
    )


def _add_sandbox(rows: SandboxRepository, sandbox_id: str, tmp_path: Path) -> None:
    rows.reserve_name(f"k8s_POD_{sandbox_id}", sandbox_id)
    rows.insert(sandbox_id, f"k8s_POD_{sandbox_id}", "sandbox storage", "runc", _pod(), tmp_path)


def test_an_old_database_calls_creating_in_flight_after_the_upgrade(tmp_path: Path) -> None:
    # A database as the schema before the rename left it, with a creation interrupted.
    path = tmp_path / "state.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:4]:
        conn.executescript(script)
    conn.execute("PRAGMA user_version = 4")
    conn.execute(
        "INSERT INTO sandboxes (id, name, phase, stage, state, created_at, runtime_handler, "
        "config, sandbox_dir) VALUES ('s1', 'pod', 'creating', 'sandbox network', 'notready', "
        "1, 'runc', x'', '/s1'), ('s2', 'pod2', 'visible', 'sandbox ready', 'ready', 2, "
        "'runc', x'', '/s2')"
    )
    conn.execute(
        "INSERT INTO containers (id, name, sandbox_id, phase, stage, state, created_at, config) "
        "VALUES ('c1', 'ctr', 's2', 'creating', 'container spec', 'created', 3, x'')"
    )
    conn.commit()
    conn.close()

    db = Database(path)
    assert db.schema_version == len(MIGRATIONS)
    sandboxes = {row.id: row.phase for row in SandboxRepository(db).phases()}
    assert sandboxes == {"s1": Phase.IN_FLIGHT, "s2": Phase.VISIBLE}
    assert [row.phase for row in ContainerRepository(db).phases()] == [Phase.IN_FLIGHT]


def test_a_new_row_is_in_flight_and_invisible_until_published(tmp_path: Path) -> None:
    rows = SandboxRepository(Database(tmp_path / "state.db"))
    _add_sandbox(rows, "abc123", tmp_path)
    assert [row.phase for row in rows.phases()] == [Phase.IN_FLIGHT]
    assert rows.find_visible("abc") is None
    rows.mark_cached("abc123", until=123.0)
    assert rows.list_visible() == []
    rows.mark_visible("abc123")
    found = rows.find_visible("abc")
    assert found is not None and found.id == "abc123" and not found.ready


def test_find_visible_by_prefix(tmp_path: Path) -> None:
    rows = SandboxRepository(Database(tmp_path / "state.db"))
    for sandbox_id in ("abc1", "abc2", "a_c3"):
        _add_sandbox(rows, sandbox_id, tmp_path)
        rows.mark_visible(sandbox_id)
    with pytest.raises(InvalidArgument, match="ambiguous"):
        rows.find_visible("abc")
    found = rows.find_visible("abc2")
    assert found is not None and found.id == "abc2"
    # `_` is a LIKE wildcard: it must match itself only.
    found = rows.find_visible("a_")
    assert found is not None and found.id == "a_c3"
    with pytest.raises(InvalidArgument, match="must not be empty"):
        rows.find_visible("")


def test_ready_and_not_ready_transitions_are_reported_once(tmp_path: Path) -> None:
    rows = SandboxRepository(Database(tmp_path / "state.db"))
    _add_sandbox(rows, "s1", tmp_path)
    rows.set_namespaces("s1", net=Path("/run/netns/s1"), ipc=None, uts=None, user=None)
    rows.mark_ready("s1", ["10.88.0.2"], {"cniVersion": "1.0.0"})
    rows.mark_visible("s1")
    sandbox = rows.visible("s1")
    assert sandbox is not None and sandbox.ready and sandbox.ips == ["10.88.0.2"]
    assert rows.pinned_paths() == {"/run/netns/s1"}
    assert rows.mark_not_ready("s1") is True
    assert rows.mark_not_ready("s1") is False


def test_forget_drops_the_row_its_name_and_its_allocations(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    rows, ledger = SandboxRepository(db), Ledger(db)
    _add_sandbox(rows, "s1", tmp_path)
    ledger.allocate("ip", "10.88.0.2", "s1")
    rows.forget("s1")
    assert rows.ids() == set()
    assert [(k, v) for k, v, owner in ledger.all() if owner == "s1"] == []
    assert db.query("SELECT * FROM names") == []


def test_a_name_without_a_row_is_dropped_at_restore(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    rows = SandboxRepository(db)
    rows.reserve_name("k8s_POD_lost", "lost")
    _add_sandbox(rows, "kept", tmp_path)
    ContainerRepository(db).reserve_name("k8s_app_lost", "lost-container")
    rows.drop_names_without_rows()
    names = {row[0] for row in db.query("SELECT object_id FROM names")}
    # Only this kind's names: the container's reservation is the container's business.
    assert names == {"kept", "lost-container"}


def test_container_exit_is_recorded_once_and_layers_accumulate(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    sandboxes, containers = SandboxRepository(db), ContainerRepository(db)
    _add_sandbox(sandboxes, "s1", tmp_path)
    add_container(containers, "c1", "s1")
    containers.mark_visible("c1")
    containers.mark_running("c1", started_at=10)
    assert containers.mark_exited("c1", 0, 20, "Completed") is True
    assert containers.mark_exited("c1", 1, 30, "Error") is False
    container = containers.visible("c1")
    assert container is not None
    assert (container.state, container.exit_code, container.finished_at) == (EXITED, 0, 20)
    containers.add_layers("c1", ["l2", "l1"])
    assert containers.layers_in_use() == {"l1", "l2"}
    assert containers.sandbox_of("c1") == "s1"
    assert sandboxes.runtime_handler("s1") == "runc"
    assert [c.id for c in containers.list_visible_in("s1")] == ["c1"]
    assert containers.list_visible_in("other") == []
