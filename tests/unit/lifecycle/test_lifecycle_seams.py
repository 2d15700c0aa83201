"""The lifecycle's steps against fakes at its seams: the pod's containers, the coordinator,
the undo actions. The rows are a real (temporary) state database."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.creation.coordinator import Phase
from cri_shim.lifecycle.containers import ContainerLifecycle
from cri_shim.lifecycle.events import (
    CONTAINER_CREATED,
    CONTAINER_DELETED,
    CONTAINER_STARTED,
    CONTAINER_STOPPED,
    ContainerEvent,
    EventBus,
)
from cri_shim.lifecycle.persisted_creation import PersistedCreationHooks, restore_creations
from cri_shim.lifecycle.sandboxes import Pods, SandboxLifecycle
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.state.containers import EXITED, ContainerRepository
from cri_shim.state.db import Database
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.state.sandboxes import SandboxRepository
from tests.unit.state.row_fixtures import add_container


class FakePodContainers:
    """Records what a pod's stop and removal asked of its containers."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def stop_all_in(self, sandbox_id: str) -> None:
        self.calls.append(f"stop containers of {sandbox_id}")

    async def remove_all_in(self, sandbox_id: str) -> None:
        self.calls.append(f"remove containers of {sandbox_id}")


class FakeCoordinator:
    def __init__(self) -> None:
        self.restored: list[tuple[str, str, str]] = []

    def restore_cached(self, name: str, object_id: str) -> float:
        self.restored.append((Phase.CACHED, name, object_id))
        return 0.0

    def restore_visible(self, name: str, object_id: str) -> None:
        self.restored.append((Phase.VISIBLE, name, object_id))


def _fake_undo_actions(journal: Journal, calls: list[str]) -> None:
    """In place of the host steps the lifecycle registered: record what was undone."""
    for action in ("cni_del", "unpin", "unmount", "remove_dir"):

        async def undo(args: dict[str, Any], action: str = action) -> None:
            calls.append(f"{action} {args['path']}")

        journal.register(action, undo)


def _add(rows: SandboxRepository, sandbox_id: str, tmp_path: Path) -> None:
    config = api_pb2.PodSandboxConfig(metadata=api_pb2.PodSandboxMetadata(name=sandbox_id))
    rows.reserve_name(f"pod-{sandbox_id}", sandbox_id)
    rows.insert(sandbox_id, f"pod-{sandbox_id}", "sandbox storage", "runc", config, tmp_path)


class RecordingBus(EventBus):
    def __init__(self) -> None:
        super().__init__()
        self.emitted: list[tuple[str, int]] = []

    def emit(self, container_id: str, sandbox_id: str, kind: int) -> ContainerEvent | None:  # type: ignore[override]
        self.emitted.append((container_id, kind))
        return None


def _sandboxes(
    tmp_path: Path, calls: list[str], cgroup_manager: str = "auto"
) -> tuple[SandboxLifecycle, RecordingBus]:
    db = Database(tmp_path / "state.db")
    bus = RecordingBus()
    journal = Journal(db, first_backoff=0.0)
    lifecycle = SandboxLifecycle(
        Config(root=tmp_path / "root", run_root=tmp_path / "run", cgroup_manager=cgroup_manager),
        Pods(SandboxRepository(db)),
        journal,
        Ledger(db),
        pinner=None,  # type: ignore[arg-type]  # no step here reaches the host
        cni=None,  # type: ignore[arg-type]
        events=bus,
        containers=FakePodContainers(calls),
        handler_features=lambda handler: HandlerFeatures(),
    )
    _fake_undo_actions(journal, calls)
    return lifecycle, bus


async def test_publish_announces_and_cleanup_removes_containers_before_undoing(
    tmp_path: Path,
) -> None:
    calls: list[str] = []
    sandboxes, _bus = _sandboxes(tmp_path, calls)
    hooks = PersistedCreationHooks(
        sandboxes.rows,
        sandboxes._journal,
        1.0,
        published=lambda object_id: calls.append(f"published {object_id}"),
        before_undo=FakePodContainers(calls).remove_all_in,
    )
    _add(sandboxes.rows, "s1", tmp_path)
    sandboxes._journal.record("s1", "remove_dir", path="/dir")
    sandboxes._journal.record("s1", "unmount", path="/dir/shm")
    hooks.publish("s1")
    assert sandboxes.find("s1") is not None
    await hooks.cleanup("s1")
    assert calls == [
        "published s1",
        "remove containers of s1",
        "unmount /dir/shm",
        "remove_dir /dir",
    ]
    assert sandboxes.rows.ids() == set()


async def test_restore_rolls_back_what_was_in_flight_and_keeps_the_rest(tmp_path: Path) -> None:
    calls: list[str] = []
    sandboxes, _bus = _sandboxes(tmp_path, calls)
    rows = sandboxes.rows
    for sandbox_id in ("interrupted", "cached", "visible"):
        _add(rows, sandbox_id, tmp_path)
    sandboxes._journal.record("interrupted", "remove_dir", path="/interrupted")
    rows.mark_cached("cached", until=0.0)
    rows.mark_visible("visible")
    rows.reserve_name("pod-never-started", "never-started")
    coordinator = FakeCoordinator()
    await restore_creations(rows, coordinator, sandboxes._journal, 1.0)  # type: ignore[arg-type]
    assert calls == ["remove_dir /interrupted"]
    assert rows.ids() == {"cached", "visible"}
    assert sorted(coordinator.restored) == [
        (Phase.CACHED, "pod-cached", "cached"),
        (Phase.VISIBLE, "pod-visible", "visible"),
    ]
    names = {row[0] for row in sandboxes.rows._db.query("SELECT object_id FROM names")}
    assert names == {"cached", "visible"}


async def test_stop_reaches_the_containers_first_and_keeps_the_directory(tmp_path: Path) -> None:
    calls: list[str] = []
    sandboxes, bus = _sandboxes(tmp_path, calls)
    _add(sandboxes.rows, "s1", tmp_path)
    sandboxes._journal.record("s1", "remove_dir", path="/dir")
    sandboxes._journal.record("s1", "unmount", path="/dir/shm")
    sandboxes.rows.mark_ready("s1", [], None)
    sandboxes.rows.mark_visible("s1")
    await sandboxes.stop("s1")
    assert calls == ["stop containers of s1", "unmount /dir/shm"]
    sandbox = sandboxes.find("s1")
    assert sandbox is not None and not sandbox.ready
    assert bus.emitted == [("s1", CONTAINER_STOPPED)]
    # Stopping again is no transition: no second event.
    await sandboxes.stop("s1")
    assert bus.emitted == [("s1", CONTAINER_STOPPED)]


async def test_remove_takes_the_containers_then_everything_else(tmp_path: Path) -> None:
    calls: list[str] = []
    sandboxes, bus = _sandboxes(tmp_path, calls)
    _add(sandboxes.rows, "s1", tmp_path)
    sandboxes._journal.record("s1", "remove_dir", path="/dir")
    sandboxes.rows.mark_visible("s1")
    sandboxes.coordinator.restore_visible("pod-s1", "s1")
    await sandboxes.remove("s1")
    assert calls == ["remove containers of s1", "remove_dir /dir"]
    assert sandboxes.rows.ids() == set()
    assert bus.emitted == [("s1", CONTAINER_DELETED)]
    # The name is free again: the coordinator no longer knows it.
    assert sandboxes.coordinator.stats()["visible"] == 0


async def test_a_published_pod_is_announced_created_then_started(tmp_path: Path) -> None:
    sandboxes, bus = _sandboxes(tmp_path, [])
    _add(sandboxes.rows, "s1", tmp_path)
    sandboxes._run.announce("s1")
    assert bus.emitted == [("s1", CONTAINER_CREATED), ("s1", CONTAINER_STARTED)]


class FakeBackend:
    """A runtime handler that records its calls; a stopped container exits with 137."""

    runtime_path = "/nonexistent/runc"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.exits: dict[str, tuple[int, int]] = {}

    async def stop(self, container_id: str, timeout: float, stop_signal: int) -> None:
        self.calls.append(f"stop {container_id} with {int(stop_signal)}")
        await asyncio.sleep(0)  # as runc kill does: another call may run meanwhile
        self.exits[container_id] = (137, 2_000)

    def exit_status(self, container_id: str) -> tuple[int, int] | None:
        return self.exits.get(container_id)

    def recorded_exits(self) -> set[str]:
        return set(self.exits)

    def oom_killed(self, container_id: str) -> bool:
        return False

    def monitor_died(self, container_id: str) -> bool:
        return False


def _containers(
    tmp_path: Path, calls: list[str]
) -> tuple[ContainerLifecycle, RecordingBus, FakeBackend]:
    db = Database(tmp_path / "state.db")
    sandbox_rows = SandboxRepository(db)
    _add(sandbox_rows, "s1", tmp_path)
    sandbox_rows.mark_visible("s1")
    bus = RecordingBus()
    journal = Journal(db, first_backoff=0.0)
    backend = FakeBackend(calls)
    lifecycle = ContainerLifecycle(
        Config(root=tmp_path / "root", run_root=tmp_path / "run"),
        ContainerRepository(db),
        Pods(sandbox_rows),
        journal,
        images=None,  # type: ignore[arg-type]  # no step here reads an image
        backends={"runc": backend},  # type: ignore[dict-item]
        events=bus,
    )

    async def remove_log(args: dict[str, Any]) -> None:
        calls.append(f"remove log {args['path']}")

    journal.register("container_log", remove_log)
    return lifecycle, bus, backend


async def test_a_published_container_keeps_its_log_and_is_announced(tmp_path: Path) -> None:
    calls: list[str] = []
    containers, bus, _backend = _containers(tmp_path, calls)
    add_container(containers.rows, "c1", "s1")
    containers._journal.record("c1", "container_log", path="/logs/app.log")
    containers._create.announce("c1")
    assert bus.emitted == [("c1", CONTAINER_CREATED)]
    # kubelet removes the log of a container it knew of: the journal no longer does.
    await containers._journal.undo("c1")
    assert calls == []


async def test_a_pod_stop_kills_its_never_started_containers_once(tmp_path: Path) -> None:
    calls: list[str] = []
    containers, bus, _backend = _containers(tmp_path, calls)
    for container_id in ("c1", "c2"):
        add_container(containers.rows, container_id, "s1")
        containers.rows.mark_visible(container_id)
    await containers.stop_all_in("s1")
    assert sorted(calls) == ["stop c1 with 9", "stop c2 with 9"]
    assert sorted(bus.emitted) == [("c1", CONTAINER_STOPPED), ("c2", CONTAINER_STOPPED)]
    stopped = containers.get("c1")
    assert (stopped.state, stopped.exit_code, stopped.reason) == (EXITED, 137, "Error")
    # Stopping what has exited does nothing, and announces nothing.
    await containers.stop_all_in("s1")
    assert len(calls) == 2 and len(bus.emitted) == 2


async def test_two_removals_at_once_delete_the_container_once(tmp_path: Path) -> None:
    calls: list[str] = []
    containers, bus, _backend = _containers(tmp_path, calls)
    add_container(containers.rows, "c1", "s1")
    containers.rows.mark_visible("c1")
    containers.coordinator.restore_visible("k8s_app_c1", "c1")
    # Both succeed: the second waits for the first, then finds the container gone.
    await asyncio.gather(containers.remove("c1"), containers.remove("c1"))
    assert calls == ["stop c1 with 9"]
    assert bus.emitted == [("c1", CONTAINER_STOPPED), ("c1", CONTAINER_DELETED)]
    assert containers.find("c1") is None


async def test_two_pod_removals_at_once_undo_and_announce_once(tmp_path: Path) -> None:
    calls: list[str] = []
    sandboxes, bus = _sandboxes(tmp_path, calls)
    _add(sandboxes.rows, "s1", tmp_path)
    sandboxes._journal.record("s1", "remove_dir", path="/dir")
    sandboxes.rows.mark_visible("s1")
    sandboxes.coordinator.restore_visible("pod-s1", "s1")
    await asyncio.gather(sandboxes.remove("s1"), sandboxes.remove("s1"), sandboxes.stop("s1"))
    assert calls == ["remove containers of s1", "remove_dir /dir"]
    assert bus.emitted == [("s1", CONTAINER_DELETED)]
