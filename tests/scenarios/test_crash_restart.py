"""kill -9 at every creation and teardown step, then restart: nothing leaks, names come back.

The daemon is made to `os._exit` at a named step (CRI_SHIM_FAULT, test-only). After a
restart without the fault, the world must be consistent: an interrupted creation is rolled
back and its name usable again; an interrupted removal completes when retried.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from cri_shim import faults
from cri_shim.api.v1 import api_pb2
from tests.harness import (
    CniTestNetwork,
    Daemon,
    import_image,
    pod_config,
    userns_linux,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

IMAGE = "docker.io/library/busybox:latest"
SANDBOX_TEARDOWN = ("undo:cni_del", "undo:unpin", "undo:unmount", "undo:remove_dir")
CONTAINER_TEARDOWN = ("undo:runtime_delete", "undo:rootfs_unmount", "undo:container_dir")


def run_pod(
    daemon: Daemon,
    name: str = "crash",
    timeout: float = 30,
    config: api_pb2.PodSandboxConfig | None = None,
) -> str:
    request = api_pb2.RunPodSandboxRequest(config=config or pod_config(name))
    return daemon.runtime().RunPodSandbox(request, timeout=timeout).pod_sandbox_id


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
    )


def listed(daemon: Daemon) -> list[str]:
    return [
        i.id
        for i in daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=5).items
    ]


def crash_and_restart(daemon: Daemon, fault: str, call, *, may_answer: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Restart `daemon` with the fault armed, make `call` hit it, then restart clean.

    `may_answer`: the fault is in work that runs after the call has answered (a
    removal's teardown), so the call may succeed before the daemon dies.
    """
    daemon.stop()
    daemon.env = {faults.ENV: fault}
    daemon.start()
    try:
        call()
    except grpc.RpcError as error:
        assert error.code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.UNKNOWN,
            grpc.StatusCode.INTERNAL,
        ), error
    else:
        assert may_answer, f"{fault}: the call answered before the fault point"
    assert daemon.proc is not None
    assert daemon.proc.wait(10) == faults.EXIT_CODE, daemon.log()
    daemon.proc = None
    daemon.env = {}
    daemon.start()


@pytest.mark.parametrize("fault", faults.SANDBOX_CREATE)
def test_crash_during_sandbox_creation(
    daemon: Daemon, test_network: CniTestNetwork, fault: str
) -> None:
    crash_and_restart(daemon, fault, lambda: run_pod(daemon))
    assert listed(daemon) == []
    assert daemon.leaks() == {}, daemon.log()
    sandbox_id = run_pod(daemon)  # the name is free again
    assert listed(daemon) == [sandbox_id]
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


@pytest.mark.parametrize("fault", SANDBOX_TEARDOWN)
def test_crash_during_sandbox_removal(daemon: Daemon, fault: str) -> None:
    sandbox_id = run_pod(daemon)
    crash_and_restart(daemon, fault, lambda: remove_pod(daemon, sandbox_id))
    remove_pod(daemon, sandbox_id)  # kubelet retries the removal
    assert listed(daemon) == []
    assert daemon.leaks() == {}, daemon.log()


def test_cached_sandbox_survives_kill9_and_is_claimed_without_second_add(
    make_daemon,
    test_network: CniTestNetwork,  # type: ignore[no-untyped-def]
) -> None:
    daemon: Daemon = make_daemon()
    daemon.start()
    test_network.delay_file.write_text("2")
    with pytest.raises(grpc.RpcError):
        run_pod(daemon, "cached", timeout=0.5)
    (cached,) = wait_until(lambda: daemon.rows("sandboxes", "phase = 'cached'"), timeout=15)
    daemon.kill9()
    daemon.start()
    assert listed(daemon) == []  # still invisible after restore
    # The row tells when the fresh expiry that restore gave it runs out.
    (restored,) = daemon.rows("sandboxes", "phase = 'cached'")
    assert restored["cached_until"] > cached["cached_until"]
    sandbox_id = run_pod(daemon, "cached", timeout=5)
    assert test_network.adds() == 1
    status = (
        daemon.runtime()
        .PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=5)
        .status
    )
    assert status.state == api_pb2.SANDBOX_READY and status.network.ip
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}


def test_orphans_under_the_roots_are_removed_at_start(daemon: Daemon) -> None:
    sandbox_id = run_pod(daemon)
    daemon.kill9()
    # the database forgets the sandbox (as if lost); its pins and directory remain
    subprocess.run(
        [
            "sqlite3",
            str(daemon.root / "state.db"),
            "DELETE FROM sandboxes; DELETE FROM names; DELETE FROM journal; "
            "DELETE FROM allocations;",
        ],
        check=True,
    )
    assert (daemon.run_root / "netns" / sandbox_id).exists()
    daemon.start()
    leaks = daemon.leaks()
    # pins, mounts and directories are ours to clean; the CNI attachment is not ours to guess
    assert not {"netns", "utsns", "ipcns", "mounts", "sandbox_dirs"} & set(leaks), leaks
    assert "orphan" in daemon.log()


# ---- containers -------------------------------------------------------------------


def _create_container(
    daemon: Daemon, sandbox_id: str, sandbox_config: api_pb2.PodSandboxConfig | None = None
) -> str:
    return (
        daemon.runtime()
        .CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=sandbox_id,
                config=api_pb2.ContainerConfig(
                    metadata=api_pb2.ContainerMetadata(name="c"),
                    image=api_pb2.ImageSpec(image=IMAGE),
                    command=["sleep", "300"],
                    log_path="c/0.log",  # under the pod's log directory, if it has one
                ),
                sandbox_config=sandbox_config or pod_config("crash"),
            ),
            timeout=60,
        )
        .container_id
    )


def _containers(daemon: Daemon) -> list[str]:
    return [
        c.id
        for c in daemon.runtime()
        .ListContainers(api_pb2.ListContainersRequest(), timeout=5)
        .containers
    ]


def _runc_containers(daemon: Daemon) -> list[str]:
    out = subprocess.run(
        ["runc", "--root", str(daemon.run_root / "runtime" / "runc"), "list", "-q"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split()


@pytest.mark.parametrize("fault", faults.CONTAINER_CREATE)
def test_crash_during_container_creation(daemon: Daemon, busybox_layout: Path, fault: str) -> None:
    import_image(daemon, busybox_layout)
    logs = daemon.base / "pod-logs"
    config = pod_config("crash", log_directory=str(logs))
    sandbox_id = run_pod(daemon, config=config)
    crash_and_restart(daemon, fault, lambda: _create_container(daemon, sandbox_id, config))
    assert _containers(daemon) == []
    assert daemon.rows("containers") == []
    assert _runc_containers(daemon) == []
    assert not (logs / "c" / "0.log").exists()  # kubelet counts attempts by these files
    container_id = _create_container(daemon, sandbox_id, config)  # the name is free again
    assert _containers(daemon) == [container_id]
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


@pytest.mark.parametrize("fault", faults.NRI_CREATE)
def test_crash_after_nri_plugins_heard_of_a_creation(
    make_daemon, busybox_layout: Path, short_tmp: Path, fault: str
) -> None:  # type: ignore[no-untyped-def]
    """The NRI steps are journaled like the others: a creation killed after plugins were
    told of it is rolled back on restart, and its name comes back."""
    daemon = make_daemon(settings={"nri": {"enable": True, "socket_path": str(short_tmp / "n")}})
    daemon.start()
    import_image(daemon, busybox_layout)
    config = pod_config("crash", log_directory=str(daemon.base / "pod-logs"))
    if fault.startswith("sandbox:"):
        crash_and_restart(daemon, fault, lambda: run_pod(daemon, config=config))
        assert listed(daemon) == []
        sandbox_id = run_pod(daemon, config=config)
    else:
        sandbox_id = run_pod(daemon, config=config)
        crash_and_restart(daemon, fault, lambda: _create_container(daemon, sandbox_id, config))
        assert daemon.rows("containers") == [] and _runc_containers(daemon) == []
        assert _create_container(daemon, sandbox_id, config)  # the name is free again
    assert not daemon.rows(
        "journal",
        "action LIKE 'nri_%' AND object_id NOT IN "
        "(SELECT id FROM sandboxes UNION SELECT id FROM containers)",
    )
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert daemon.rows("journal") == []


@pytest.mark.parametrize("fault", faults.CONTAINER_REMOVE + CONTAINER_TEARDOWN)
def test_crash_during_container_removal(daemon: Daemon, busybox_layout: Path, fault: str) -> None:
    """RemoveContainer answers before its teardown; a crash in the teardown is rolled
    forward at restart: the container stays gone and nothing is left behind."""
    import_image(daemon, busybox_layout)
    sandbox_id = run_pod(daemon)
    container_id = _create_container(daemon, sandbox_id)
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    crash_and_restart(
        daemon,
        fault,
        lambda: daemon.runtime().RemoveContainer(
            api_pb2.RemoveContainerRequest(container_id=container_id), timeout=60
        ),
        may_answer=True,
    )
    assert _containers(daemon) == []
    assert daemon.rows("containers") == []
    assert _runc_containers(daemon) == []
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


def test_crash_between_runc_start_and_its_record(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)
    sandbox_id = run_pod(daemon)
    container_id = _create_container(daemon, sandbox_id)
    (fault,) = faults.CONTAINER_START
    crash_and_restart(
        daemon,
        fault,
        lambda: daemon.runtime().StartContainer(
            api_pb2.StartContainerRequest(container_id=container_id), timeout=30
        ),
    )
    # the runtime started it, and restore says so; a retried start is told it runs (as
    # CRI-O and containerd answer), rather than failing inside runc
    status = (
        daemon.runtime()
        .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=5)
        .status
    )
    assert status.state == api_pb2.CONTAINER_RUNNING
    with pytest.raises(grpc.RpcError) as retry:
        daemon.runtime().StartContainer(
            api_pb2.StartContainerRequest(container_id=container_id), timeout=30
        )
    assert retry.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "is running" in retry.value.details()
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


# ---- pods with a user namespace of their own ----------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "sandbox:namespaces",
        "sandbox:network-added",
        "container:rootfs",
        "container:runtime-created",
    ],
)
def test_crash_while_making_a_user_namespaced_pod(
    daemon: Daemon, busybox_layout: Path, fault: str
) -> None:
    """The user namespace pin, the idmapped layers and the staged idmapped mounts are
    rolled back like every other step."""
    import_image(daemon, busybox_layout)
    config = pod_config("crash-userns", linux=userns_linux(65536 * 3100))

    def make() -> None:
        sandbox_id = (
            daemon.runtime()
            .RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=30)
            .pod_sandbox_id
        )
        _create_container(daemon, sandbox_id, config)

    crash_and_restart(daemon, fault, make)
    assert _containers(daemon) == []
    for sandbox_id in listed(daemon):  # a crash at a container step leaves the pod
        remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


# A handler whose pods are sandboxes (gVisor): the sandbox container's steps. The runsc
# Debian ships needs `--network=host` on Linux 6.11 and newer (tests/integration/
# test_cri_runsc.py says why).
_RUNSC = shutil.which("runsc")
_RUNSC_HANDLERS = {
    "runc": {"path": "runc"},
    "runsc": {"path": str(_RUNSC), "runtime_args": ["--network=host"]},
}


def _runsc_containers(daemon: Daemon) -> list[str]:
    root = daemon.run_root / "runtime" / "runsc"
    listed = subprocess.run(
        [str(_RUNSC), "--root", str(root), "list", "-quiet"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return listed.stdout.split()


@pytest.mark.skipif(_RUNSC is None, reason="runsc (gVisor) is not installed")
@pytest.mark.parametrize("fault", (*faults.POD_SANDBOX_CREATE, "undo:pause_delete"))
def test_crash_at_a_pod_sandbox_step_leaks_nothing(make_daemon, fault: str) -> None:  # type: ignore[no-untyped-def]
    daemon: Daemon = make_daemon(settings={"runtime": {"handlers": _RUNSC_HANDLERS}})
    daemon.start()
    config = pod_config("gv")

    def run() -> str:
        request = api_pb2.RunPodSandboxRequest(config=config, runtime_handler="runsc")
        return daemon.runtime().RunPodSandbox(request, timeout=60).pod_sandbox_id

    if fault.startswith("undo:"):
        sandbox_id = run()
        assert _runsc_containers(daemon) == [sandbox_id]
        crash_and_restart(daemon, fault, lambda: remove_pod(daemon, sandbox_id))
        remove_pod(daemon, sandbox_id)  # kubelet retries the removal
    else:
        crash_and_restart(daemon, fault, run)
        assert listed(daemon) == []
        sandbox_id = run()  # the name is free again
        assert _runsc_containers(daemon) == [sandbox_id]
        remove_pod(daemon, sandbox_id)
    assert listed(daemon) == []
    assert _runsc_containers(daemon) == []
    assert daemon.leaks() == {}, daemon.log()
