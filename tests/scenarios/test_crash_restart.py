"""kill -9 at every creation and teardown step, then restart: nothing leaks, names come back.

The daemon is made to `os._exit` at a named step (CRI_SHIM_FAULT, test-only). After a
restart without the fault, the world must be consistent: an interrupted creation is rolled
back and its name usable again; an interrupted removal completes when retried.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
from pathlib import Path
from signal import SIGKILL

import grpc
import pytest

from cri_shim import faults
from cri_shim.api.v1 import api_pb2
from tests.harness import (
    CniTestNetwork,
    Daemon,
    conmon_of,
    import_image,
    pod_config,
    runtime_leaks,
    userns_linux,
    wait_until,
)
from tests.scenarios.test_kubelet_retry_container import (
    create,
    creates,
    held,
    hold_file,
    slow_pod,  # noqa: F401 (the fixture: a pod on a handler whose `runc create` is held)
)
from tests.scenarios.test_kubelet_retry_container import listed as listed_containers

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow]

IMAGE = "docker.io/library/busybox:latest"
# The undo steps, by the journal that holds them when the daemon is killed. Each test
# checks that the journal it kills in holds exactly its steps, and tests/unit/test_faults.py
# that every undo step of the code is in one of them.
SANDBOX_TEARDOWN = tuple(
    faults.undo_point(action)
    for action in (
        "nri_pod_stopped",
        "cni_del",
        "unpin",
        "pause_delete",
        "unmount",
        "nri_pod_removed",
        "remove_dir",
    )
)
CONTAINER_TEARDOWN = tuple(
    faults.undo_point(action)
    for action in (
        "nri_container_stopped",
        "runtime_delete",
        "rootfs_unmount",
        "container_dir",
        "nri_container_removed",
    )
)
# An interrupted creation's: the log file is kubelet's once the container is announced,
# so only a rollback removes it.
CONTAINER_ROLLBACK = tuple(
    faults.undo_point(action)
    for action in (
        "runtime_delete",
        "container_log",
        "rootfs_unmount",
        "container_dir",
        "nri_container_removed",
    )
)
# The last point of a container's creation: every step is journaled by then.
LAST_CONTAINER_STEP = faults.CONTAINER_CREATE[-1]


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


def journaled(daemon: Daemon, where: str) -> set[str]:
    """The fault points of the undo steps journaled for the objects `where` selects."""
    return {faults.undo_point(row["action"]) for row in daemon.rows("journal", where)}


@pytest.fixture
def nri_daemon(make_daemon, short_tmp: Path) -> Daemon:  # type: ignore[no-untyped-def]
    """A daemon serving NRI (no plugin needs to connect): its objects journal what NRI
    plugins are to hear of their end, with the other steps."""
    daemon: Daemon = make_daemon(
        settings={"nri": {"enable": True, "socket_path": str(short_tmp / "nri.sock")}}
    )
    daemon.start()
    return daemon


def crash_and_restart(daemon: Daemon, fault: str, call, *, may_answer: bool = False) -> bool:  # type: ignore[no-untyped-def]
    """Restart `daemon` with the fault armed, make `call` hit it, then restart clean.
    Whether the call answered before the daemon died.

    `may_answer`: the fault is in work that runs after the call has answered (a
    removal's teardown), so the call may succeed before the daemon dies.
    """
    daemon.stop()
    daemon.env = {faults.ENV: fault}
    daemon.start()
    answered = False
    try:
        call()
        answered = True
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
    return answered


def killed_while_restoring(daemon: Daemon, fault: str) -> None:
    """Start the stopped `daemon` with `fault` armed: restore, rolling back what the last
    crash interrupted, reaches it before serving. Then start it clean."""
    daemon.env = {faults.ENV: fault}
    daemon.start(wait=False)
    assert daemon.proc is not None
    assert daemon.proc.wait(60) == faults.EXIT_CODE, daemon.log()
    assert f"fault injected at {fault}" in daemon.log()
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
def test_crash_during_sandbox_removal(nri_daemon: Daemon, fault: str) -> None:
    """A pod with every step a pod can have: NRI told of it, a pause process (its
    containers share its PID namespace)."""
    daemon = nri_daemon
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(pid=api_pb2.POD)
        )
    )
    sandbox_id = run_pod(daemon, config=pod_config("crash", linux=linux))
    assert journaled(daemon, f"object_id = '{sandbox_id}'") == set(SANDBOX_TEARDOWN)
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
def test_crash_during_container_removal(
    nri_daemon: Daemon, busybox_layout: Path, fault: str
) -> None:
    """RemoveContainer answers before its teardown; a crash in the teardown is rolled
    forward at restart: the container stays gone and nothing is left behind."""
    daemon = nri_daemon
    import_image(daemon, busybox_layout)
    sandbox_id = run_pod(daemon)
    container_id = _create_container(daemon, sandbox_id)
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    assert journaled(daemon, f"object_id = '{container_id}'") == set(CONTAINER_TEARDOWN)

    def remove() -> None:
        daemon.runtime().RemoveContainer(
            api_pb2.RemoveContainerRequest(container_id=container_id), timeout=60
        )

    if crash_and_restart(daemon, fault, remove, may_answer=True):
        # Answered, then killed in the teardown: restore finished it before serving.
        assert daemon.rows("containers") == [] and _runc_containers(daemon) == []
    else:
        # Killed before the answer (NRI plugins are told of the stop and the removal
        # first), or with it lost: kubelet retries; the teardown follows the answer.
        remove()
        wait_until(lambda: daemon.rows("containers") == [], timeout=30)
    assert _containers(daemon) == []
    assert _runc_containers(daemon) == []
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


@pytest.mark.parametrize("fault", faults.MONITOR_DIED)
def test_crash_while_ending_a_container_whose_monitor_died(
    daemon: Daemon, busybox_layout: Path, fault: str
) -> None:
    """Killed after the runtime's container was deleted, before its exit was written:
    the restart finishes the ending (it is neither running nor lost to a reboot)."""
    import_image(daemon, busybox_layout)
    sandbox_id = run_pod(daemon)
    container_id = _create_container(daemon, sandbox_id)
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    conmon = conmon_of(daemon, container_id)
    crash_and_restart(daemon, fault, lambda: os.kill(conmon, SIGKILL), may_answer=True)
    status = (
        daemon.runtime()
        .ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=5)
        .status
    )
    assert status.state == api_pb2.CONTAINER_EXITED
    assert (status.exit_code, status.reason) == (255, "Error")
    assert "monitor (conmon) died" in status.message
    assert _runc_containers(daemon) == []
    daemon.runtime().RemoveContainer(
        api_pb2.RemoveContainerRequest(container_id=container_id), timeout=60
    )
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert runtime_leaks(daemon) == {}


@pytest.mark.parametrize("fault", CONTAINER_ROLLBACK)
def test_crash_while_restore_rolls_back_an_interrupted_creation(
    nri_daemon: Daemon, busybox_layout: Path, fault: str
) -> None:
    """Killed again while the restart rolls back a creation killed at its last step: the
    next start finishes the rollback (the journal keeps each step until it is done). The
    log file goes with it, as kubelet counts attempts by these files."""
    daemon = nri_daemon
    import_image(daemon, busybox_layout)
    logs = daemon.base / "pod-logs"
    config = pod_config("crash", log_directory=str(logs))
    sandbox_id = run_pod(daemon, config=config)
    daemon.stop()
    daemon.env = {faults.ENV: LAST_CONTAINER_STEP}
    daemon.start()
    with pytest.raises(grpc.RpcError):
        _create_container(daemon, sandbox_id, config)
    assert daemon.proc is not None
    assert daemon.proc.wait(10) == faults.EXIT_CODE, daemon.log()
    daemon.proc = None
    assert (logs / "c" / "0.log").exists()
    assert journaled(daemon, f"object_id != '{sandbox_id}'") == set(CONTAINER_ROLLBACK)
    killed_while_restoring(daemon, fault)
    assert _containers(daemon) == []
    assert daemon.rows("containers") == [] and _runc_containers(daemon) == []
    assert daemon.rows("journal", f"object_id != '{sandbox_id}'") == []
    assert not (logs / "c" / "0.log").exists()
    assert _create_container(daemon, sandbox_id, config)  # the name is free again
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []


@pytest.mark.parametrize("fault", faults.CONTAINER_START)
def test_crash_between_runc_start_and_its_record(
    daemon: Daemon, busybox_layout: Path, fault: str
) -> None:
    import_image(daemon, busybox_layout)
    sandbox_id = run_pod(daemon)
    container_id = _create_container(daemon, sandbox_id)
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


# ---- a restart with creations cached or waited on ------------------------------------


def test_cached_container_survives_kill9_and_is_claimed_by_a_retry(slow_pod) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """kubelet's CreateContainer timed out, the creation finished into the cache, then the
    daemon was killed: after the restart the container is still invisible, and kubelet's
    retry claims it, the one `runc create` there was."""
    daemon, sandbox_id, config, delay, count = slow_pod
    with held(delay):
        with pytest.raises(grpc.RpcError) as first:
            create(daemon, sandbox_id, config, timeout=1.5)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (cached,) = wait_until(lambda: daemon.rows("containers", "phase = 'cached'"), timeout=30)
    daemon.kill9()
    daemon.start()
    assert listed_containers(daemon) == []  # still invisible after restore
    (restored,) = daemon.rows("containers", "phase = 'cached'")
    assert restored["cached_until"] > cached["cached_until"]  # a fresh expiry
    assert create(daemon, sandbox_id, config, timeout=30) == cached["id"]
    assert daemon.creations("container")["counters"]["claimed"] == 1
    assert listed_containers(daemon) == [cached["id"]] and creates(count) == 1
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=cached["id"]), timeout=30
    )
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    daemon.stop()
    assert runtime_leaks(daemon) == {}


def _runtime_calls(daemon: Daemon) -> list[str]:
    """The CNI plugins and `runc create` calls a killed daemon started that still run."""
    return [
        process
        for process in runtime_leaks(daemon).get("processes", [])
        if " create " in f" {process} " or "slow-cni" in process
    ]


def _restart_under(daemon: Daemon, signal: str, waiting, release) -> None:  # type: ignore[no-untyped-def]
    """Stop `daemon` by `signal` while a duplicate request waits on a held creation: the
    waiting client is told the daemon went away. Then let the creation go and start again."""
    assert daemon.proc is not None
    if signal == "SIGKILL":
        daemon.kill9()
    else:
        daemon.proc.terminate()
    with pytest.raises(grpc.RpcError) as waited:
        waiting.result(timeout=60)
    assert waited.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), (
        waited.value
    )
    release()
    daemon.stop()
    # What the killed daemon started ends before the restart rolls its creation back.
    wait_until(lambda: not _runtime_calls(daemon), timeout=60)
    daemon.start()


@pytest.mark.parametrize("signal", ["SIGKILL", "SIGTERM"])
def test_restart_while_a_duplicate_run_pod_sandbox_waits(
    daemon: Daemon, test_network: CniTestNetwork, signal: str
) -> None:
    config = pod_config("waited")
    with concurrent.futures.ThreadPoolExecutor(1) as pool, test_network.held():
        with pytest.raises(grpc.RpcError) as first:
            run_pod(daemon, timeout=1.5, config=config)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waiting = pool.submit(run_pod, daemon, "waited", 120, config)
        wait_until(lambda: _watchers(daemon, "sandbox") == 1, timeout=30)
        _restart_under(daemon, signal, waiting, test_network.hold_file.unlink)
    sandbox_id = run_pod(daemon, timeout=60, config=config)  # kubelet's retry
    assert listed(daemon) == [sandbox_id]
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    daemon.stop()
    assert runtime_leaks(daemon) == {}


@pytest.mark.parametrize("signal", ["SIGKILL", "SIGTERM"])
def test_restart_while_a_duplicate_create_container_waits(slow_pod, signal: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    daemon, sandbox_id, config, delay, _ = slow_pod
    with concurrent.futures.ThreadPoolExecutor(1) as pool, held(delay):
        with pytest.raises(grpc.RpcError) as first:
            create(daemon, sandbox_id, config, timeout=1.5)
        assert first.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waiting = pool.submit(create, daemon, sandbox_id, config, 120)
        wait_until(lambda: _watchers(daemon, "container") == 1, timeout=30)
        _restart_under(daemon, signal, waiting, hold_file(delay).unlink)
    # kubelet's retry: the container the graceful stop finished, or a clean creation
    # after the kill's rollback; one container either way.
    container_id = create(daemon, sandbox_id, config, timeout=60)
    assert listed_containers(daemon) == [container_id]
    daemon.runtime().StartContainer(
        api_pb2.StartContainerRequest(container_id=container_id), timeout=30
    )
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}, daemon.log()
    assert _runc_containers(daemon) == []
    daemon.stop()
    assert runtime_leaks(daemon) == {}


def _watchers(daemon: Daemon, kind: str) -> int:
    """How many duplicate requests wait on the creations of `kind` in flight."""
    return sum(c["watchers"] for c in daemon.creations(kind)["in_flight"])


# ---- a handler whose pods are sandboxes (gVisor) -------------------------------------

# The runsc Debian ships needs `--network=host` on Linux 6.11 and newer (tests/integration/
# test_cri_runsc.py says why).
_RUNSC = shutil.which("runsc")
_RUNSC_HANDLERS = {
    "runc": {"path": "runc"},
    "runsc": {"path": str(_RUNSC), "runtime_args": ["--network=host"]},
}
# A runsc pod's removal: its sandbox container lets go of the interfaces before CNI DEL.
RUNSC_SANDBOX_TEARDOWN = (faults.undo_point("pause_delete"),)


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


@pytest.fixture
def runsc_daemon(make_daemon) -> Daemon:  # type: ignore[no-untyped-def]
    if _RUNSC is None:
        pytest.skip("runsc (gVisor) is not installed")
    daemon: Daemon = make_daemon(settings={"runtime": {"handlers": _RUNSC_HANDLERS}})
    daemon.start()
    return daemon


def _run_runsc_pod(daemon: Daemon) -> str:
    request = api_pb2.RunPodSandboxRequest(config=pod_config("gv"), runtime_handler="runsc")
    return daemon.runtime().RunPodSandbox(request, timeout=60).pod_sandbox_id


@pytest.mark.parametrize("fault", faults.POD_SANDBOX_CREATE)
def test_crash_while_starting_a_pod_sandbox_container(runsc_daemon: Daemon, fault: str) -> None:
    daemon = runsc_daemon
    crash_and_restart(daemon, fault, lambda: _run_runsc_pod(daemon))
    assert listed(daemon) == []
    assert _runsc_containers(daemon) == []
    assert daemon.leaks() == {}, daemon.log()
    sandbox_id = _run_runsc_pod(daemon)  # the name is free again
    assert _runsc_containers(daemon) == [sandbox_id]
    remove_pod(daemon, sandbox_id)
    assert listed(daemon) == []
    assert _runsc_containers(daemon) == []
    assert daemon.leaks() == {}, daemon.log()


@pytest.mark.parametrize("fault", RUNSC_SANDBOX_TEARDOWN)
def test_crash_while_removing_a_pod_sandbox_container(runsc_daemon: Daemon, fault: str) -> None:
    daemon = runsc_daemon
    sandbox_id = _run_runsc_pod(daemon)
    assert _runsc_containers(daemon) == [sandbox_id]
    assert set(RUNSC_SANDBOX_TEARDOWN) <= journaled(daemon, f"object_id = '{sandbox_id}'")
    crash_and_restart(daemon, fault, lambda: remove_pod(daemon, sandbox_id))
    remove_pod(daemon, sandbox_id)  # kubelet retries the removal
    assert listed(daemon) == []
    assert _runsc_containers(daemon) == []
    assert daemon.leaks() == {}, daemon.log()
