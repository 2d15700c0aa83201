"""The visible objects held in memory beside their rows (state/objects.py): every write
through a repository shows in the very next read, an object that leaves the visible set
leaves the index, and an unchanged object is answered without reading its row or making
its CRI item again."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.statuses import (
    to_container,
    to_pod_sandbox,
    to_pod_sandbox_status,
    to_status,
)
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.sandboxes import SandboxRepository
from tests.unit.state.row_fixtures import add_container


class CountingDatabase(Database):
    """The real database, counting the reads made through it."""

    reads = 0

    def query(self, sql: str, params: Any = ()) -> list[sqlite3.Row]:
        self.reads += 1
        return super().query(sql, params)

    def query_one(self, sql: str, params: Any = ()) -> sqlite3.Row | None:
        self.reads += 1
        return super().query_one(sql, params)


@pytest.fixture
def db(tmp_path: Path) -> CountingDatabase:
    return CountingDatabase(tmp_path / "state.db")


def add_sandbox(rows: SandboxRepository, sandbox_id: str) -> None:
    config = api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name=sandbox_id, namespace="default", uid="u"),
        labels={"app": sandbox_id},
    )
    rows.insert(sandbox_id, f"k8s_POD_{sandbox_id}", "sandbox storage", "runc", config, Path("/s"))


def visible_container(rows: ContainerRepository, container_id: str, sandbox_id: str) -> None:
    add_container(rows, container_id, sandbox_id)
    rows.mark_visible(container_id)


def test_each_container_write_shows_in_the_next_list_and_status(db: Database) -> None:
    rows = ContainerRepository(db)
    add_container(rows, "c1", "s1")
    assert rows.list_visible() == []  # read while in flight: invisible
    rows.mark_visible("c1")
    assert [to_container(c).state for c in rows.list_visible()] == [api_pb2.CONTAINER_CREATED]
    rows.set_created("c1", 42, {"uid": 7, "gid": 8})
    container = rows.visible("c1")
    assert container is not None and container.pid == 42
    assert to_status(container).user.linux.uid == 7
    rows.mark_running("c1", started_at=10)
    (running,) = rows.list_visible()
    assert (to_container(running).state, to_status(running).started_at) == (
        api_pb2.CONTAINER_RUNNING,
        10,
    )
    rows.mark_exited("c1", 3, 20, "Error")
    (exited,) = rows.list_visible_in("s1")
    status = to_status(exited)
    assert (status.state, status.exit_code, status.reason) == (api_pb2.CONTAINER_EXITED, 3, "Error")
    # An exit the daemon had to make up, with what it knows of it; a recorded exit stays.
    assert not rows.mark_exited("c1", 255, 30, "Unknown", message="gone")
    kept = rows.visible("c1")
    assert kept is not None and (kept.exit_code, kept.message) == (3, "")
    visible_container(rows, "c2", "s1")
    rows.mark_running("c2", started_at=10)
    assert rows.mark_exited("c2", 255, 30, "Unknown", message="gone")
    lost = rows.visible("c2")
    assert lost is not None and (lost.exit_code, lost.message) == (255, "gone")


def test_an_object_that_stops_being_visible_leaves_the_index(db: Database) -> None:
    rows = ContainerRepository(db)
    visible_container(rows, "c1", "s1")
    visible_container(rows, "c2", "s1")
    assert [c.id for c in rows.list_visible()] == ["c1", "c2"]
    rows.mark_cleaning("c1")  # removal starts: no List or Status sees it any more
    assert [c.id for c in rows.list_visible()] == ["c2"]
    assert rows.visible("c1") is None and rows.find_visible("c1") is None
    rows.forget("c1")
    rows.forget("c2")
    assert rows.list_visible() == [] and rows.list_visible_in("s1") == []
    assert rows.visible("c2") is None


def test_each_sandbox_write_shows_in_the_next_list_and_status(db: Database) -> None:
    rows = SandboxRepository(db)
    add_sandbox(rows, "s1")
    assert rows.list_visible() == []
    rows.set_namespaces("s1", net=Path("/run/netns/s1"), ipc=None, uts=None, user=None)
    rows.mark_ready("s1", ["10.88.0.2"], None)
    rows.mark_visible("s1")
    (sandbox,) = rows.list_visible()
    assert sandbox.netns_path == Path("/run/netns/s1")
    assert to_pod_sandbox(sandbox).state == api_pb2.SANDBOX_READY
    assert to_pod_sandbox_status(sandbox).network.ip == "10.88.0.2"
    rows.mark_not_ready("s1")
    stopped = rows.find_visible("s")
    assert stopped is not None
    assert to_pod_sandbox(stopped).state == api_pb2.SANDBOX_NOTREADY
    assert to_pod_sandbox_status(stopped).network.ip == ""


def test_an_object_made_visible_later_is_listed_in_creation_order(db: Database) -> None:
    # A cached object claimed after a newer one was published: listed by creation time.
    rows = SandboxRepository(db)
    add_sandbox(rows, "older")
    add_sandbox(rows, "newer")
    rows.mark_cached("older", until=1e12)
    rows.mark_visible("newer")
    assert [s.id for s in rows.list_visible()] == ["newer"]
    rows.mark_visible("older")
    assert [s.id for s in rows.list_visible()] == ["older", "newer"]


def test_an_unchanged_object_costs_no_read_and_keeps_its_items(db: CountingDatabase) -> None:
    rows = ContainerRepository(db)
    for n in range(3):
        visible_container(rows, f"c{n}", "s1")
    first = rows.list_visible()
    items = [to_container(c) for c in first]
    reads = db.reads
    again = rows.list_visible()
    assert db.reads == reads
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert all(to_container(c) is item for c, item in zip(again, items, strict=True))
    assert to_status(again[0]) is to_status(first[0])
    # One write: that one row is read again, and only its items are made anew.
    rows.mark_running("c1", started_at=5)
    after = rows.list_visible()
    assert db.reads == reads + 1
    assert after[0] is first[0] and after[2] is first[2]
    assert to_container(after[1]) is not items[1]
    assert to_container(after[1]).state == api_pb2.CONTAINER_RUNNING
    assert items[1].state == api_pb2.CONTAINER_CREATED  # what was handed out stays as it was


def test_records_cannot_be_changed_behind_the_index(db: Database) -> None:
    rows = ContainerRepository(db)
    visible_container(rows, "c1", "s1")
    (container,) = rows.list_visible()
    with pytest.raises(dataclasses.FrozenInstanceError):
        container.state = "exited"  # type: ignore[misc]
    assert dataclasses.replace(container, state="exited").state == "exited"
    (listed,) = rows.list_visible()
    assert listed.state == "created"


def test_writes_nobody_reads_are_not_held_for_ever(db: CountingDatabase) -> None:
    # A daemon that churns objects while nobody lists: the index is read whole again
    # rather than remembering every object touched.
    rows = SandboxRepository(db)
    add_sandbox(rows, "kept")
    rows.mark_visible("kept")
    assert [s.id for s in rows.list_visible()] == ["kept"]
    for n in range(400):
        add_sandbox(rows, f"gone{n}")
        rows.forget(f"gone{n}")
    rows.mark_not_ready("kept")
    reads = db.reads
    (kept,) = rows.list_visible()
    assert db.reads == reads + 1  # one read of every visible row, not 401 of one row each
    assert not kept.ready
