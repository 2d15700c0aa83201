"""The cgroup drivers against the real daemon.

Here (any host): the driver the daemon runs is the one RuntimeConfig and Status report, a
pod whose cgroup parent is of the other driver's form, or of its own but one it cannot
name (a ':' in a slice, whitespace or control characters), is refused before anything
is made, and `systemd` where systemd does not run stops the start.

With cgroup v2 and systemd as PID 1 (the QEMU guest lane, scripts/guest): a pod under a
kubelet-style slice runs with real runc `--systemd-cgroup` and real StartTransientUnit
calls; the container is in its scope, conmon in its own, stats read the scope's files,
and removing the pod leaves no unit, scope or cgroup of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.runtime.cgroup_driver import systemd_booted
from tests.harness import Daemon, pod_config
from tests.integration.cri_testkit import (
    container_config,
    create,
    import_image,
    pod,
    run_to_exit,
    start,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSTEMD_V2 = systemd_booted() and (CGROUP_ROOT / "cgroup.controllers").exists()
needs_systemd_v2 = pytest.mark.skipif(
    not SYSTEMD_V2, reason="needs cgroup v2 with systemd as PID 1 (scripts/guest runs it)"
)
# kubelet's slice of a BestEffort pod (kubepods-besteffort-pod<uid with _>.slice).
POD_SLICE = "kubepods-besteffort-pod0a1b2c3d_0000_4000_8000_00000000cafe.slice"
POD_SLICE_DIR = f"kubepods.slice/kubepods-besteffort.slice/{POD_SLICE}"
# The daemon's start under the guest's emulation takes far longer than here.
START_TIMEOUT = 180.0


def verbose_config(daemon: Daemon) -> dict[str, object]:
    info = daemon.runtime().Status(api_pb2.StatusRequest(verbose=True), timeout=10).info["info"]
    config: dict[str, object] = json.loads(info)["config"]
    return config


def driver(daemon: Daemon) -> int:
    answer = daemon.runtime().RuntimeConfig(api_pb2.RuntimeConfigRequest(), timeout=10)
    return int(answer.linux.cgroup_driver)


@pytest.fixture
def daemon(make_daemon: type) -> Daemon:
    """The default daemon (`auto`), given the time a start takes in the guest."""
    started: Daemon = make_daemon()
    started.start(timeout=START_TIMEOUT)
    return started


def test_the_running_driver_is_the_one_reported(daemon: Daemon) -> None:
    expected = "systemd" if systemd_booted() else "cgroupfs"  # `auto`, the default
    assert verbose_config(daemon)["cgroup_manager"] == expected
    assert driver(daemon) == (api_pb2.SYSTEMD if systemd_booted() else api_pb2.CGROUPFS)


def test_a_parent_of_the_other_drivers_form_is_refused_before_anything_is_made(
    daemon: Daemon,
) -> None:
    other = "/kubepods/besteffort/pod1" if systemd_booted() else POD_SLICE
    config = pod_config(linux=api_pb2.LinuxPodSandboxConfig(cgroup_parent=other))
    with pytest.raises(grpc.RpcError) as info:
        daemon.runtime().RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("PodSandboxConfig.linux.cgroup_parent:")
    assert "--cgroup-driver=" in (info.value.details() or "")
    listed = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
    assert not listed.items
    assert not list((daemon.root / "sandboxes").glob("*"))


# Parents of each driver's own form that it cannot name: a slice with ':' becomes a
# cgroupsPath with three (`a:b.slice:cri-shim:<id>`) that is then read as a cgroupfs path.
UNNAMEABLE_PARENTS = {
    "systemd": [
        "/kubepods.slice/a:b.slice",
        "kubepods-a:b.slice",
        "/kubepods.slice/kubepods besteffort.slice",
        "kubepods-pod\x1b1.slice",
    ],
    "cgroupfs": [
        "/kubepods/besteffort/pod 1",
        "/kubepods/besteffort/pod1\n0::/elsewhere",
        "/kubepods/besteffort/pod\t1",
        "/kubepods/besteffort/pod\x7f1",
    ],
}


def test_a_parent_its_driver_cannot_name_is_refused_before_anything_is_made(
    daemon: Daemon,
) -> None:
    running = "systemd" if systemd_booted() else "cgroupfs"
    for parent in UNNAMEABLE_PARENTS[running]:
        config = pod_config(linux=api_pb2.LinuxPodSandboxConfig(cgroup_parent=parent))
        with pytest.raises(grpc.RpcError) as info:
            daemon.runtime().RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (parent, info.value)
        details = info.value.details() or ""
        assert details.startswith("PodSandboxConfig.linux.cgroup_parent: "), details
    listed = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10)
    assert not listed.items
    assert not list((daemon.root / "sandboxes").glob("*"))


@pytest.mark.skipif(systemd_booted(), reason="needs a host that systemd does not run")
def test_systemd_where_systemd_does_not_run_stops_the_start(make_daemon: type) -> None:
    daemon = make_daemon(settings={"cgroup_manager": "systemd"})
    with pytest.raises(RuntimeError):
        daemon.start(timeout=15)
    assert daemon.proc is not None and daemon.proc.wait(timeout=10) == 2
    log = daemon.log_path.read_text()
    assert 'cgroup_manager: "systemd" is configured, but systemd does not run' in log


def cgroup_of(pid: int) -> str:
    """A process's cgroup v2 path (the `0::` line of /proc/<pid>/cgroup)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"no cgroup v2 line for {pid}")


def our_units() -> list[str]:
    out = subprocess.run(
        ["systemctl", "list-units", "--all", "--plain", "--no-legend", "cri-shim-*"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.strip())


@needs_systemd_v2
@pytest.mark.parametrize("runtime", ["runc", "crun"])
def test_a_pod_under_systemd_runs_in_scopes_and_leaves_none(
    make_daemon: type, busybox_layout: Path, short_tmp: Path, runtime: str
) -> None:
    if shutil.which(runtime) is None:
        pytest.skip(f"{runtime} is not installed")
    # `auto`, the default: systemd runs this host.
    handlers = {"default_handler": runtime, "handlers": {runtime: {"path": runtime}}}
    daemon = make_daemon(settings={"conmon_cgroup": "pod", "runtime": handlers})
    daemon.start(timeout=START_TIMEOUT)
    try:
        assert driver(daemon) == api_pb2.SYSTEMD
        assert verbose_config(daemon)["cgroup_manager"] == "systemd"
        import_image(daemon, busybox_layout)
        # The host's network: no CNI, nothing this test is about (and fewer slow calls).
        node_network = api_pb2.NamespaceOption(network=api_pb2.NODE)
        linux = api_pb2.LinuxPodSandboxConfig(
            cgroup_parent=POD_SLICE,
            security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=node_network),
        )
        with pod(daemon, "sd", short_tmp, linux=linux) as p:
            container_id = create(daemon, p, container_config("sleeper", "sleep 300"))
            start(daemon, container_id)
            request = api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True)
            info = json.loads(daemon.runtime().ContainerStatus(request, timeout=10).info["info"])
            assert info["runtimeSpec"]["linux"]["cgroupsPath"] == (
                f"{POD_SLICE}:cri-shim:{container_id}"
            )
            scope = f"/{POD_SLICE_DIR}/cri-shim-{container_id}.scope"
            # runc runs the container in its scope; crun in the scope's `container` child.
            own = cgroup_of(int(info["pid"]))
            assert own in (scope, f"{scope}/container")
            conmon = int(json.loads(_meta(daemon, container_id))["conmon_pid"])
            assert cgroup_of(conmon) == f"/{POD_SLICE_DIR}/cri-shim-conmon-{container_id}.scope"
            assert f"cri-shim-{container_id}.scope" in our_units()
            stats = daemon.runtime().ContainerStats(
                api_pb2.ContainerStatsRequest(container_id=container_id), timeout=10
            )
            assert stats.stats.memory.working_set_bytes.value > 0  # read from the scope
            if (CGROUP_ROOT / scope[1:] / "memory.pressure").exists():
                assert stats.stats.memory.HasField("psi") and stats.stats.io.HasField("psi")
            # The runtime updates the container's cgroup through systemd (--systemd-cgroup).
            limit = api_pb2.LinuxContainerResources(memory_limit_in_bytes=64 << 20)
            daemon.runtime().UpdateContainerResources(
                api_pb2.UpdateContainerResourcesRequest(container_id=container_id, linux=limit),
                timeout=60,
            )
            assert (CGROUP_ROOT / own[1:] / "memory.max").read_text().strip() == str(64 << 20)
            # An OOM kill seen in the scope's memory.events.
            hog = container_config(
                "hog",
                "tail /dev/zero",
                linux=api_pb2.LinuxContainerConfig(
                    resources=api_pb2.LinuxContainerResources(memory_limit_in_bytes=32 << 20)
                ),
            )
            exited = run_to_exit(daemon, p, hog, timeout=120)
            assert exited.exit_code == 137
        deadline = time.monotonic() + 30
        while our_units() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert our_units() == []
        assert not list((CGROUP_ROOT / POD_SLICE_DIR).glob("cri-shim-*"))
        # Under crun too, whose container runs in the scope's `container` child: the OOM
        # watch reads the scope's memory.events, which counts its children's kills.
        assert exited.reason == "OOMKilled"
    finally:
        daemon.stop()
        # The pod's slice is kubelet's (it made it; here systemd did, for the scopes).
        subprocess.run(["systemctl", "stop", POD_SLICE], check=False, capture_output=True)


def _meta(daemon: Daemon, container_id: str) -> str:
    (path,) = daemon.run_root.rglob(f"containers/{container_id}/meta.json")
    return path.read_text()
