"""Pod PID namespace sharing (shareProcessNamespace) against the real daemon: a pause
process is the pod's PID 1, the pod's containers see each other's processes, orphans are
reaped, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    pod,
    start,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]


def _linux(pid: int) -> dict[str, api_pb2.LinuxPodSandboxConfig]:
    options = api_pb2.NamespaceOption(pid=pid)
    return {
        "linux": api_pb2.LinuxPodSandboxConfig(
            security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=options)
        )
    }


def _container(name: str, script: str, pid: int) -> api_pb2.ContainerConfig:
    return container_config(
        name,
        script,
        linux=api_pb2.LinuxContainerConfig(
            security_context=api_pb2.LinuxContainerSecurityContext(
                namespace_options=api_pb2.NamespaceOption(pid=pid)
            )
        ),
    )


def _runc_ids(daemon: Daemon) -> list[str]:
    root = daemon.run_root / "runtime" / "runc"
    out = subprocess.run(
        ["runc", "--root", str(root), "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [entry["id"] for entry in json.loads(out) or []]


def _ps(daemon: Daemon, container_id: str) -> str:
    return exec_sync(daemon, container_id, ["ps", "-o", "pid,stat,args"]).stdout.decode()


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def test_containers_of_a_pod_see_each_others_processes(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "shared", short_tmp, **_linux(api_pb2.POD)) as p:
        sandbox_id = p[0]
        assert sandbox_id in _runc_ids(daemon)  # the pause process
        first = create(daemon, p, _container("first", "exec sleep 300", api_pb2.POD))
        start(daemon, first)
        second = create(daemon, p, _container("second", "exec sleep 301", api_pb2.POD))
        start(daemon, second)

        seen = _ps(daemon, second)
        assert "sleep 300" in seen and "sleep 301" in seen, seen
        # PID 1 is the pause program, not a container's process.
        assert exec_sync(daemon, first, ["cat", "/proc/1/cmdline"]).stdout == b"/pause\0"

        # An orphan is re-parented to the pause process, which reaps it: no zombie stays.
        exec_sync(daemon, second, ["sh", "-c", "(sleep 0.2 &) ; exit 0"])

        def orphan_reaped() -> bool:
            seen = _ps(daemon, first)
            zombies = [line for line in seen.splitlines()[1:] if " Z " in line]
            return "sleep 0.2" not in seen and zombies == []

        wait_until(orphan_reaped, timeout=10)

        # The pause process survives a daemon restart (it is no orphan to reconcile).
        daemon.restart()
        third = create(daemon, p, _container("third", "exec sleep 302", api_pb2.POD))
        start(daemon, third)
        assert "sleep 300" in _ps(daemon, third)
    assert _runc_ids(daemon) == []
    assert daemon.leaks() == {}


def test_without_sharing_each_container_has_its_own(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "private", short_tmp) as p:
        assert _runc_ids(daemon) == []  # no pause process for such a pod
        first = create(daemon, p, _container("first", "exec sleep 300", api_pb2.CONTAINER))
        start(daemon, first)
        second = create(daemon, p, _container("second", "exec sleep 301", api_pb2.CONTAINER))
        start(daemon, second)
        seen = _ps(daemon, second)
        assert "sleep 301" in seen and "sleep 300" not in seen
    assert daemon.leaks() == {}


def test_stopping_the_pod_ends_its_pid_namespace(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "stopped", short_tmp, **_linux(api_pb2.POD)) as p:
        sandbox_id = p[0]
        container_id = create(daemon, p, _container("c", "exec sleep 300", api_pb2.POD))
        start(daemon, container_id)
        daemon.runtime().StopPodSandbox(
            api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
        )
        assert sandbox_id not in _runc_ids(daemon)
        status = daemon.runtime().ContainerStatus(
            api_pb2.ContainerStatusRequest(container_id=container_id), timeout=10
        )
        assert status.status.state == api_pb2.CONTAINER_EXITED


def test_a_pod_whose_pause_process_dies_is_not_ready(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "killed", short_tmp, **_linux(api_pb2.POD)) as p:
        sandbox_id = p[0]
        root = daemon.run_root / "runtime" / "runc"
        subprocess.run(["runc", "--root", str(root), "kill", sandbox_id, "KILL"], check=True)

        def state() -> int:
            return (
                daemon.runtime()
                .PodSandboxStatus(
                    api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=10
                )
                .status.state
            )

        wait_until(lambda: state() == api_pb2.SANDBOX_NOTREADY, timeout=30)
