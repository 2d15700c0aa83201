"""The daemon as a node runs it: installed by scripts/install as its systemd unit
(Type=notify, Delegate=yes, KillMode=process) on a cgroup v2 host with systemd as PID 1.

Runs in the guest (`scripts/guest --lane`, or `scripts/guest -- .venv/bin/pytest
tests/guest`); anywhere else it is skipped, since it installs into /etc and starts a
system unit. The unit runs the checkout's environment (`scripts/install --venv .venv`):
building the package into /opt under emulation would take minutes and test nothing more.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.guest.serving import wait_serving
from tests.harness import BUSYBOX_IMAGE, REPO, import_command, pod_config
from tests.imagebuild import cached_oci_layout

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONFIG = Path("/etc/cri-shim/config.toml")
SOCKET = "unix:///run/cri-shim/cri-shim.sock"
# Under emulation each runc call takes a second or two; a StartContainer that waits for a
# notification that never comes takes 31 s.
RPC_TIMEOUT = 25

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not (os.environ.get("CRI_SHIM_GUEST") and Path("/run/systemd/system").is_dir()),
        reason="installs and starts the system unit: only in the guest (scripts/guest --lane)",
    ),
    pytest.mark.skipif(
        not (CGROUP_ROOT / "cgroup.controllers").exists(), reason="not a cgroup v2 host"
    ),
]


def systemctl(*args: str) -> str:
    return subprocess.run(
        ["systemctl", *args], check=True, capture_output=True, text=True, timeout=180
    ).stdout


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[api_pb2_grpc.RuntimeServiceStub]:
    subprocess.run(
        [str(REPO / "scripts" / "install"), "--venv", str(REPO / ".venv")],
        check=True,
        timeout=120,
    )
    layout = cached_oci_layout(tmp_path_factory.mktemp("images"))
    subprocess.run(import_command(CONFIG, layout, BUSYBOX_IMAGE), check=True, cwd=REPO, timeout=300)
    # Type=notify: `systemctl start` returns once the daemon said READY=1, as soon as it
    # answers the socket; the calls below are timed from its restore's end.
    systemctl("start", "cri-shim")
    wait_serving()
    channel = grpc.insecure_channel(SOCKET)
    try:
        yield api_pb2_grpc.RuntimeServiceStub(channel)
    finally:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        for pod in stub.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=60).items:
            stub.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=120)
            stub.RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=120
            )
        channel.close()
        # The socket unit too, which the service's start started (Requires=): a node the
        # tests leave holds nothing of the daemon's (tests/guest/leftovers.py).
        subprocess.run(
            ["systemctl", "stop", "cri-shim", "cri-shim.socket"], timeout=180, check=False
        )
        subprocess.run(["journalctl", "-u", "cri-shim", "--no-pager", "-n", "40"], check=False)


def unit_cgroup() -> Path:
    """The cgroup systemd made for (and delegated to) the unit."""
    return CGROUP_ROOT / systemctl("show", "-P", "ControlGroup", "cri-shim").strip().lstrip("/")


def test_the_unit_is_ready_and_delegated(runtime: api_pb2_grpc.RuntimeServiceStub) -> None:
    assert systemctl("show", "-P", "ActiveState", "cri-shim").strip() == "active"
    assert systemctl("show", "-P", "Delegate", "cri-shim").strip() == "yes"
    status = runtime.Status(api_pb2.StatusRequest(), timeout=RPC_TIMEOUT).status
    assert all(condition.status for condition in status.conditions), status


def test_a_container_starts_in_a_cgroup_namespace_and_outlives_a_restart(
    runtime: api_pb2_grpc.RuntimeServiceStub,
) -> None:
    pod = pod_config(name="unit-pod", uid="unit-pod-uid")
    pod_id = runtime.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=pod), timeout=120
    ).pod_sandbox_id
    config = api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="sleeper"),
        image=api_pb2.ImageSpec(image=BUSYBOX_IMAGE),
        command=["/bin/sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"],
        linux=api_pb2.LinuxContainerConfig(
            resources=api_pb2.LinuxContainerResources(
                memory_limit_in_bytes=64 << 20,
                cpu_quota=50000,
                cpu_period=100000,
                cpu_shares=512,
            )
        ),
    )
    container_id = runtime.CreateContainer(
        api_pb2.CreateContainerRequest(pod_sandbox_id=pod_id, config=config, sandbox_config=pod),
        timeout=120,
    ).container_id
    # The daemon's NOTIFY_SOCKET once reached runc, which then waited 31 s for the
    # container's READY=1, or failed binding its relay socket.
    runtime.StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=RPC_TIMEOUT
    )
    status = runtime.ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True), timeout=RPC_TIMEOUT
    )
    assert status.status.state == api_pb2.CONTAINER_RUNNING
    pid = json.loads(status.info["info"])["pid"]

    # A cgroup namespace of its own: the container sees its cgroup as the root.
    inside = runtime.ExecSync(
        api_pb2.ExecSyncRequest(
            container_id=container_id, cmd=["cat", "/proc/self/cgroup"], timeout=20
        ),
        timeout=RPC_TIMEOUT,
    )
    assert inside.exit_code == 0, inside.stderr
    assert inside.stdout.decode().strip() == "0::/"

    # The installed daemon's default driver (`auto`) is systemd's on this host: without a
    # cgroup_parent the container is a scope systemd made in system.slice, outside the
    # unit's cgroup (systemd could not start the unit again while it had children with
    # controllers). It has the limits.
    host_path = Path(f"/proc/{pid}").joinpath("cgroup").read_text().strip().split("::", 1)[1]
    assert host_path == f"/system.slice/cri-shim-{container_id}.scope"
    driver = runtime.RuntimeConfig(api_pb2.RuntimeConfigRequest(), timeout=RPC_TIMEOUT)
    assert driver.linux.cgroup_driver == api_pb2.SYSTEMD  # what kubelet's driver follows
    group = CGROUP_ROOT / host_path.lstrip("/")
    assert not group.is_relative_to(unit_cgroup())
    assert (group / "memory.max").read_text().strip() == str(64 << 20)
    assert (group / "cpu.max").read_text().split() == ["50000", "100000"]
    assert (group / "cpu.weight").read_text().strip() != "100"  # 512 shares, not the default

    # A restart (KillMode=process) keeps the container running, and the restarted daemon
    # starts the unit again (READY=1) and finds it.
    systemctl("restart", "cri-shim")
    assert systemctl("show", "-P", "ActiveState", "cri-shim").strip() == "active"
    wait_serving()
    again = runtime.ContainerStatus(
        api_pb2.ContainerStatusRequest(container_id=container_id),
        timeout=RPC_TIMEOUT,
        wait_for_ready=True,  # the channel reconnects to the new process
    )
    assert again.status.state == api_pb2.CONTAINER_RUNNING
    assert Path(f"/proc/{pid}").exists()

    stats = runtime.ContainerStats(
        api_pb2.ContainerStatsRequest(container_id=container_id), timeout=RPC_TIMEOUT
    ).stats
    assert stats.memory.working_set_bytes.value > 0
    assert stats.cpu.timestamp > 0
    runtime.StopContainer(
        api_pb2.StopContainerRequest(container_id=container_id, timeout=10), timeout=60
    )
    runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=120)
    runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=120)
    assert not group.exists()
