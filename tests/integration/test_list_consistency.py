"""List and Status answer from memory (the visible objects and their CRI items, held
beside the rows): hypothesis drives the real daemon through random lifecycles (pods run,
stopped and removed; containers created, started, stopped, removed, exiting on their
own; the daemon restarted) and after every step each List, each filter and each Status
must say exactly what a fresh read of the state database says."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cri_shim.api.v1 import api_pb2
from cri_shim.lifecycle.statuses import (
    to_container,
    to_pod_sandbox,
    to_pod_sandbox_status,
    to_status,
)
from cri_shim.state.records import ContainerRecord, SandboxRecord
from tests.harness import Daemon, import_image, pod_config
from tests.integration.cri_testkit import container_config, remove_pod

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

MAX_PODS = 3
MAX_CONTAINERS_PER_POD = 3
# What a container runs: one that runs until stopped, and one that exits on its own (its
# exit reaches the rows through the exit watcher, or the next List or Status).
SCRIPTS = {"sleeps": "exec sleep 3600", "exits": "exit 3"}
RUNNING = api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_RUNNING)
EXITED = api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_EXITED)
READY = api_pb2.PodSandboxStateValue(state=api_pb2.SANDBOX_READY)
picks = st.integers(min_value=0, max_value=MAX_PODS * MAX_CONTAINERS_PER_POD)


def fresh_rows(daemon: Daemon) -> tuple[list[SandboxRecord], list[ContainerRecord]]:
    """The visible objects as the database says, read by a connection of the test's own."""
    conn = sqlite3.connect(f"file:{daemon.root / 'state.db'}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        visible = "WHERE phase = 'visible' ORDER BY created_at"
        sandboxes = conn.execute(f"SELECT * FROM sandboxes {visible}").fetchall()
        containers = conn.execute(f"SELECT * FROM containers {visible}").fetchall()
    finally:
        conn.close()
    return (
        [SandboxRecord.from_row(row) for row in sandboxes],
        [ContainerRecord.from_row(row) for row in containers],
    )


def answers(daemon: Daemon, pod_ids: list[str], container_ids: list[str]) -> dict[str, Any]:
    """Every List (with and without filters) and every Status, as the daemon gives them."""
    rt = daemon.runtime()
    first_pod = pod_ids[0] if pod_ids else "none"

    def containers(f: api_pb2.ContainerFilter | None = None) -> list[api_pb2.Container]:
        return list(
            rt.ListContainers(api_pb2.ListContainersRequest(filter=f), timeout=30).containers
        )

    def sandboxes(f: api_pb2.PodSandboxFilter | None = None) -> list[api_pb2.PodSandbox]:
        return list(rt.ListPodSandbox(api_pb2.ListPodSandboxRequest(filter=f), timeout=30).items)

    found: dict[str, Any] = {
        "pods": sandboxes(),
        "ready pods": sandboxes(api_pb2.PodSandboxFilter(state=READY)),
        "first pod": sandboxes(api_pb2.PodSandboxFilter(id=first_pod)),
        "containers": containers(),
        "running": containers(api_pb2.ContainerFilter(state=RUNNING)),
        "exited": containers(api_pb2.ContainerFilter(state=EXITED)),
        "in first pod": containers(api_pb2.ContainerFilter(pod_sandbox_id=first_pod)),
        "exits label": containers(api_pb2.ContainerFilter(label_selector={"script": "exits"})),
    }
    for pod_id in pod_ids:
        reply = rt.PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod_id), timeout=30
        )
        found[f"pod status {pod_id}"] = (reply.status, list(reply.containers_statuses))
    for container_id in container_ids:
        found[f"status {container_id}"] = rt.ContainerStatus(
            api_pb2.ContainerStatusRequest(container_id=container_id), timeout=30
        ).status
    return found


def expected(sandboxes: list[SandboxRecord], containers: list[ContainerRecord]) -> dict[str, Any]:
    """What `answers` must be for these rows, each item made afresh from its record."""
    pods = [to_pod_sandbox(s) for s in sandboxes]
    items = [to_container(c) for c in containers]
    first_pod = sandboxes[0].id if sandboxes else "none"
    want: dict[str, Any] = {
        "pods": pods,
        "ready pods": [p for p in pods if p.state == api_pb2.SANDBOX_READY],
        "first pod": [p for p in pods if p.id == first_pod],
        "containers": items,
        "running": [c for c in items if c.state == api_pb2.CONTAINER_RUNNING],
        "exited": [c for c in items if c.state == api_pb2.CONTAINER_EXITED],
        "in first pod": [c for c in items if c.pod_sandbox_id == first_pod],
        "exits label": [c for c in items if c.labels.get("script") == "exits"],
    }
    for sandbox in sandboxes:
        own = [to_status(c) for c in containers if c.sandbox_id == sandbox.id]
        want[f"pod status {sandbox.id}"] = (to_pod_sandbox_status(sandbox), own)
    for container in containers:
        want[f"status {container.id}"] = to_status(container)
    return want


class Lifecycles(RuleBasedStateMachine):
    def __init__(self, daemon: Daemon, log_dir: Path) -> None:
        super().__init__()
        self.daemon = daemon
        self.log_dir = log_dir
        self.made = 0
        self.restarts = 0

    # ---- what is there to act on (the daemon's own word, checked by the invariant) ----

    def _pods(self) -> list[api_pb2.PodSandbox]:
        return list(
            self.daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items
        )

    def _containers(self) -> list[api_pb2.Container]:
        return list(
            self.daemon.runtime()
            .ListContainers(api_pb2.ListContainersRequest(), timeout=30)
            .containers
        )

    @staticmethod
    def _pick(pick: int, items: list[Any], keep: Callable[[Any], bool]) -> Any:
        """One of the items `keep` accepts, or None. Drawn as a number, not from the
        items: what the daemon holds differs from run to run (exits come when they
        come), and hypothesis must draw the same data when it replays a run."""
        chosen = [item for item in items if keep(item)]
        return chosen[pick % len(chosen)] if chosen else None

    # ---- pods -------------------------------------------------------------------------

    @rule()
    def run_pod(self) -> None:
        if len(self._pods()) >= MAX_PODS:
            return
        self.made += 1
        name = f"lists-{self.made}"
        config = pod_config(name, uid=name, log_directory=str(self.log_dir / name))
        self.daemon.runtime().RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=60)

    @rule(pick=picks)
    def stop_pod(self, pick: int) -> None:
        pod = self._pick(pick, self._pods(), lambda p: True)
        if pod is not None:
            self.daemon.runtime().StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60
            )

    @rule(pick=picks)
    def remove_pod(self, pick: int) -> None:
        pod = self._pick(pick, self._pods(), lambda p: True)
        if pod is not None:
            remove_pod(self.daemon, pod.id)

    # ---- containers -------------------------------------------------------------------

    @rule(pick=picks, script=st.sampled_from(sorted(SCRIPTS)), start=st.booleans())
    def create_container(self, pick: int, script: str, start: bool) -> None:
        containers = self._containers()

        def room(pod: api_pb2.PodSandbox) -> bool:
            inside = sum(c.pod_sandbox_id == pod.id for c in containers)
            return pod.state == api_pb2.SANDBOX_READY and inside < MAX_CONTAINERS_PER_POD

        pod = self._pick(pick, self._pods(), room)
        if pod is None:
            return
        self.made += 1
        config = container_config(f"c{self.made}", SCRIPTS[script], labels={"script": script})
        sandbox_config = pod_config(
            pod.metadata.name,
            uid=pod.metadata.uid,
            log_directory=str(self.log_dir / pod.metadata.name),
        )
        rt = self.daemon.runtime()
        container_id = rt.CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=sandbox_config
            ),
            timeout=60,
        ).container_id
        if start:
            rt.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=60)

    @rule(pick=picks)
    def start_container(self, pick: int) -> None:
        container = self._pick(
            pick, self._containers(), lambda c: c.state == api_pb2.CONTAINER_CREATED
        )
        if container is not None:
            self.daemon.runtime().StartContainer(
                api_pb2.StartContainerRequest(container_id=container.id), timeout=60
            )

    @rule(pick=picks)
    def stop_container(self, pick: int) -> None:
        container = self._pick(pick, self._containers(), lambda c: True)
        if container is not None:
            self.daemon.runtime().StopContainer(
                api_pb2.StopContainerRequest(container_id=container.id, timeout=0), timeout=60
            )

    @rule(pick=picks)
    def remove_container(self, pick: int) -> None:
        container = self._pick(pick, self._containers(), lambda c: True)
        if container is not None:
            self.daemon.runtime().RemoveContainer(
                api_pb2.RemoveContainerRequest(container_id=container.id), timeout=60
            )

    # ---- the daemon -------------------------------------------------------------------

    @precondition(lambda self: self.restarts < 1)
    @rule()
    def restart(self) -> None:
        self.restarts += 1
        self.daemon.restart()

    # ---- the invariant ----------------------------------------------------------------

    @invariant()
    def lists_and_statuses_say_what_the_rows_say(self) -> None:
        # An exit may be recorded while we look (by the exit watcher, or by the List or
        # Status call itself): compare only answers given while the rows held still.
        for _ in range(20):
            before = fresh_rows(self.daemon)
            ids = [s.id for s in before[0]], [c.id for c in before[1]]
            got = answers(self.daemon, *ids)
            after = fresh_rows(self.daemon)
            if after == before:
                assert got == expected(*after)
                return
        pytest.fail("the rows kept changing while the lists were read")

    def teardown(self) -> None:
        for pod in self._pods():
            remove_pod(self.daemon, pod.id)


def test_lists_and_statuses_always_say_what_the_database_says(
    daemon: Daemon, busybox_layout: Path, short_tmp: Path
) -> None:
    import_image(daemon, busybox_layout)
    run_state_machine_as_test(
        lambda: Lifecycles(daemon, short_tmp / "logs"),
        settings=settings(
            max_examples=4,
            stateful_step_count=14,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            # Every step drives the real daemon: a failure is reported as found, with its
            # steps, rather than replayed for minutes to make it shorter.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
        ),
    )
    assert daemon.leaks() == {}
