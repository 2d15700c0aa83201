"""Host paths that cover the runtime's own directories (`/`, `/run`, the run root, the
state root), as node agents and log shippers mount them, against the real daemon: the
daemon's namespace pins and mounts stay as they were whatever the propagation, every other
pod keeps working, and the propagation each mode promises still reaches the container.

The daemon runs in a mount namespace of its own whose `/` is a shared mount, as on a
systemd node: what its staging mounts could do to the mounts it shares is then confined
to it, and host-to-container and bidirectional mounts of `/` are allowed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim import faults
from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, import_image, wait_until
from tests.integration.cri_testkit import container_config, create, remove, start, stop
from tests.refused_calls import run_to_exit, running_pod
from tests.scenarios.test_crash_restart import crash_and_restart

pytestmark = [pytest.mark.integration, pytest.mark.root]

# A private copy of the test's mount namespace with `/` made shared in it, held by a
# process of its own so that a restarted daemon enters the same one.
PRIVATE_MOUNTS = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--",
    "sh",
    "-c",
    "mount --make-rshared / && exec sleep infinity",
]
PROPAGATIONS = (
    api_pb2.PROPAGATION_PRIVATE,
    api_pb2.PROPAGATION_HOST_TO_CONTAINER,
    api_pb2.PROPAGATION_BIDIRECTIONAL,
)


@pytest.fixture
def node(make_daemon: type, short_tmp: Path, busybox_layout: Path) -> Iterator[Daemon]:
    """A daemon in its own mount namespace whose run root is under /run, as by default."""
    holder = subprocess.Popen(PRIVATE_MOUNTS)
    try:
        namespace = wait_until(lambda: _shared_namespace(holder.pid), timeout=10)
    except TimeoutError:
        holder.kill()
        holder.wait()
        raise
    run_dir = Path("/run") / f"cs-{uuid.uuid4().hex[:8]}"
    wrapper = ["nsenter", "-t", str(holder.pid), "-m", "--"]
    daemon: Daemon = make_daemon(run_dir=run_dir, wrapper=wrapper)
    try:
        daemon.start()
        import_image(daemon, busybox_layout)
        yield daemon
    finally:
        daemon.stop()
        _kill_what_is_left(namespace)  # the holder too, so the namespace goes
        holder.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _shared_namespace(pid: int) -> str | None:
    """The mount namespace of the holder once it has made its `/` shared."""
    try:
        own = os.readlink("/proc/self/ns/mnt")
        namespace = os.readlink(f"/proc/{pid}/ns/mnt")
        root = [
            line
            for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            if line.split()[4] == "/"
        ]
    except OSError:
        return None
    if namespace == own or not root or "shared:" not in root[-1]:
        return None
    return namespace


def _kill_what_is_left(namespace: str) -> None:
    """Last resort after a failure that left pods behind: the monitors in the daemon's
    mount namespace and their children (the containers), so that nothing outlives it."""
    left: set[int] = set()
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "mnt") == namespace:
                left.add(int(entry.name))
            parents[int(entry.name)] = int(
                (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            )
        except OSError:
            continue
    left |= {pid for pid, parent in parents.items() if parent in left}
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def pins(daemon: Daemon) -> list[str]:
    """The namespace files the daemon has mounted under its run root."""
    return sorted(
        fields[4]
        for fields in daemon.mountinfo()
        if fields[fields.index("-") + 1] == "nsfs" and fields[4].startswith(str(daemon.run_root))
    )


def mount_table(daemon: Daemon) -> Counter[str]:
    """The mount points of the daemon's namespace, as often as something is mounted there:
    its own and the system's (/dev, /proc, ...), not the copies of other daemons' (tests
    beside this one), which go when those remove their directories."""
    own = (str(daemon.root), str(daemon.run_root))
    return Counter(
        point
        for point in (fields[4] for fields in daemon.mountinfo())
        if point.startswith(own) or not point.startswith(("/tmp/", "/run/", "/var/"))
    )


def exec_sync(daemon: Daemon, container_id: str, *cmd: str) -> api_pb2.ExecSyncResponse:
    request = api_pb2.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=20)
    return daemon.runtime().ExecSync(request, timeout=30)


def in_daemon_namespace(daemon: Daemon, *command: str) -> None:
    """Run `command` in the daemon's mount namespace (the node's, for its containers)."""
    assert daemon.proc is not None
    subprocess.run(
        ["nsenter", "-t", str(daemon.proc.pid), "-m", "--", *command], check=True, timeout=30
    )


def host_mount(propagation: int, host_path: Path, **kwargs: object) -> api_pb2.Mount:
    return api_pb2.Mount(
        container_path="/host",
        host_path=str(host_path),
        propagation=propagation,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


def assert_pods_work(daemon: Daemon, pods: list[tuple[str, api_pb2.PodSandboxConfig]]) -> None:
    """Each pod still creates and starts a container that joins its namespaces."""
    for number, pod in enumerate(pods):
        config = container_config(f"probe{number}", "hostname")
        container_id, status = run_to_exit(daemon, pod, config)
        assert status.exit_code == 0, Path(status.log_path).read_text()
        assert pod[1].hostname in Path(status.log_path).read_text()
        remove(daemon, container_id)


@pytest.mark.parametrize("covered", ["/", "/run", "run root", "state root"])
def test_a_host_path_over_the_runtimes_directories_leaves_its_mounts_alone(
    node: Daemon, short_tmp: Path, covered: str
) -> None:
    host_path = {
        "/": Path("/"),
        "/run": Path("/run"),
        "run root": node.run_root,
        "state root": node.root,
    }[covered]
    # Something the container must find through the mount: it is the host path's.
    marker = (short_tmp if covered == "/" else host_path) / f"marker-{uuid.uuid4().hex[:6]}"
    marker.write_text("seen from the container")
    inside = Path("/host") / marker.relative_to(host_path)
    logs = short_tmp / "logs"
    with (
        running_pod(node, "bystander-a", logs / "a") as pod_a,
        running_pod(node, "bystander-b", logs / "b") as pod_b,
        running_pod(node, "bystander-c", logs / "c") as pod_c,
    ):
        bystanders = [pod_a, pod_b, pod_c]
        with running_pod(node, "agent", logs / "agent") as agent:
            before = pins(node)
            assert len(before) == 12  # net, uts and ipc of four pods, each mounted once
            table = mount_table(node)
            for propagation in PROPAGATIONS:
                readonly = propagation != api_pb2.PROPAGATION_BIDIRECTIONAL
                config = container_config(
                    "agent",
                    "sleep 600",
                    mounts=[host_mount(propagation, host_path, readonly=readonly)],
                )
                container_id = create(node, agent, config)
                mode = api_pb2.MountPropagation.Name(propagation)
                assert pins(node) == before, f"{mode}: the staging mount took pins away"
                taken = table - mount_table(node)
                assert not taken, f"{mode}: the staging mount took {sorted(taken)}"
                start(node, container_id)
                seen = exec_sync(node, container_id, "cat", str(inside))
                assert seen.stdout == b"seen from the container", (mode, seen.stderr)
                stop(node, container_id)
                remove(node, container_id)
                # Its teardown goes on in the background once the call has returned.
                wait_until(lambda: mount_table(node) == table, timeout=30)
                assert_pods_work(node, bystanders)
        # The agent's pod is gone; the others' pins, files, mounts and containers are not.
        others = Counter({point: n for point, n in table.items() if agent[0] not in point})
        wait_until(lambda: mount_table(node) == others, timeout=30)
        left = pins(node)
        assert len(left) == 9
        assert all(Path(pin).is_file() for pin in left)
        assert_pods_work(node, bystanders)
    assert node.leaks() == {}


def test_each_propagation_mode_still_reaches_the_container(node: Daemon, short_tmp: Path) -> None:
    """rprivate sees nothing mounted later, rslave sees the host's later mounts, rshared
    also passes the container's own back to the host."""
    volume = short_tmp / "volume"
    (volume / "later").mkdir(parents=True)
    (volume / "back").mkdir()
    logs = short_tmp / "logs"
    privileged = api_pb2.LinuxContainerConfig(
        security_context=api_pb2.LinuxContainerSecurityContext(privileged=True)
    )
    seen: dict[int, bytes] = {}
    privileged_pod = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(privileged=True)
    )
    with running_pod(node, "modes", logs, linux=privileged_pod) as pod:
        containers = {
            propagation: create(
                node,
                pod,
                container_config(
                    f"mode{propagation}",
                    "sleep 600",
                    mounts=[host_mount(propagation, volume)],
                    linux=privileged,
                ),
            )
            for propagation in PROPAGATIONS
        }
        for container_id in containers.values():
            start(node, container_id)
        in_daemon_namespace(node, "mount", "-t", "tmpfs", "later", str(volume / "later"))
        # Written in the daemon's namespace: here the tmpfs is not mounted.
        in_daemon_namespace(node, "sh", "-c", f"printf 'mounted later' > {volume}/later/file")
        for propagation, container_id in containers.items():
            seen[propagation] = exec_sync(node, container_id, "cat", "/host/later/file").stdout
        bidirectional = containers[api_pb2.PROPAGATION_BIDIRECTIONAL]
        made = exec_sync(node, bidirectional, "mount", "-t", "tmpfs", "back", "/host/back")
        assert made.exit_code == 0, made.stderr
        back = [f[4] for f in node.mountinfo() if f[4] == str(volume / "back")]
        for container_id in containers.values():
            stop(node, container_id)
            remove(node, container_id)
        in_daemon_namespace(node, "umount", "-l", str(volume / "later"))
        if back:
            in_daemon_namespace(node, "umount", "-l", str(volume / "back"))
    assert seen[api_pb2.PROPAGATION_PRIVATE] == b""
    assert seen[api_pb2.PROPAGATION_HOST_TO_CONTAINER] == b"mounted later"
    assert seen[api_pb2.PROPAGATION_BIDIRECTIONAL] == b"mounted later"
    assert back == [str(volume / "back")], "the container's mount did not reach the host"
    assert node.leaks() == {}


@pytest.mark.parametrize("propagation", PROPAGATIONS, ids=api_pb2.MountPropagation.Name)
def test_staging_mounts_a_crash_left_are_released_without_touching_the_pins(
    node: Daemon, short_tmp: Path, propagation: int
) -> None:
    """Killed between the staging of a host path over the run root and `runc create`: the
    restore rolls the creation back, the staging mounts with it, and leaves the rest."""
    logs = short_tmp / "logs"
    with (
        running_pod(node, "bystander", logs / "a") as bystander,
        running_pod(node, "agent", logs / "agent") as agent,
    ):
        before, table = pins(node), mount_table(node)
        config = container_config(
            "agent", "sleep 600", mounts=[host_mount(propagation, node.run_root)]
        )
        crash_and_restart(node, "container:runtime-journaled", lambda: create(node, agent, config))
        with contextlib.suppress(TimeoutError):  # the restore's rollback, then the asserts
            wait_until(lambda: mount_table(node) == table, timeout=30)
        assert pins(node) == before, "releasing the staging mounts took pins away"
        taken = table - mount_table(node)
        assert not taken, f"releasing the staging mounts took {sorted(taken)}"
        assert_pods_work(node, [bystander, agent])
    assert node.leaks() == {}


def staged(mountinfo: list[list[str]], root: Path) -> tuple[list[str], list[str]]:
    """The mount points below the containers' staging directories under `root`, and those
    of them that are copies of a staging directory's mounts nested in another's."""
    points = [fields[4] for fields in mountinfo]
    stagings = {
        point.rsplit("/", 1)[0]
        for point in points
        if point.startswith(f"{root}/") and point.rsplit("/", 2)[-2:-1] == ["mounts"]
    }
    below = [p for p in points if any(p.startswith(f"{s}/") for s in stagings)]
    nested = [p for p in below if any(f"{s}/" in p.split("/mounts/", 1)[1] for s in stagings)]
    return below, nested


def test_a_host_path_of_root_stages_no_copy_of_what_is_staged(
    node: Daemon, short_tmp: Path
) -> None:
    """Killed between the staging of two host paths of `/` and `runc create`: the second
    staging mount copies the node's mounts but not the first one's, nested in its own (nor
    any other container's staged mounts); the restore releases both."""
    mounts = [
        api_pb2.Mount(container_path=path, host_path="/", readonly=True)
        for path in ("/host", "/host-again")
    ]
    with running_pod(node, "agent", short_tmp / "logs") as agent:
        table = mount_table(node)
        node.stop()
        node.env = {faults.ENV: "container:runtime-journaled"}
        node.start()
        with pytest.raises(grpc.RpcError):
            create(node, agent, container_config("agent", "sleep 600", mounts=mounts))
        assert node.proc is not None
        assert node.proc.wait(10) == faults.EXIT_CODE, node.log()
        node.proc = None
        # The daemon is gone; its namespace, held by the node, keeps what it staged.
        holder = node.wrapper[node.wrapper.index("-t") + 1]
        below, nested = staged(
            [line.split() for line in Path(f"/proc/{holder}/mountinfo").read_text().splitlines()],
            node.root,
        )
        node.env = {}
        node.start()
        wait_until(lambda: mount_table(node) == table, timeout=30)
    print(f"staged mounts: {len(below)}, nested copies of staged mounts: {len(nested)}")
    assert below, "nothing was staged"
    assert nested == [], f"{len(nested)} of {len(below)} staged mounts are copies of staged ones"
    assert node.leaks() == {}
