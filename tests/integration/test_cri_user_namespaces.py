"""Pod user namespaces (userns_options mode POD) against the real daemon and runc: the
container is root inside and a range of unprivileged ids on the host, its root filesystem
and volumes are idmapped, the pod's network belongs to its user namespace, and nothing is
left behind."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, ping, userns_linux
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    output,
    pod,
    remove,
    run_pod,
    run_to_exit,
    start,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

HOST_BASE = 3000 * 65536  # a range kubelet could hand out, far from real users' ids
SIZE = 65536
NS_GET_USERNS = 0xB701  # ioctl on a namespace fd: an fd of the user namespace owning it


def _userns(host_id: int = HOST_BASE, **options: int) -> dict[str, Any]:
    return {"linux": userns_linux(host_id, SIZE, **options)}


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def _proc_ids(pid: int) -> tuple[int, int]:
    fields = {
        line.split(":")[0]: line.split()[1:]
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    }
    return int(fields["Uid"][0]), int(fields["Gid"][0])


def test_status_advertises_user_namespaces(daemon: Daemon) -> None:
    response = daemon.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    handlers = {h.name: h.features for h in response.runtime_handlers}
    assert handlers["runc"].user_namespaces
    # Refused (test_host_namespaces_with_a_user_namespace_are_refused), so not advertised:
    # kubelet then keeps such pods in the host's user namespace.
    assert not response.features.user_namespaces_host_network


def test_the_container_is_root_inside_and_a_mapped_id_on_the_host(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "userns", short_tmp, **_userns()) as p:
        container_id = create(daemon, p, container_config("app", "exec sleep 300"))
        start(daemon, container_id)
        inside = exec_sync(
            daemon,
            container_id,
            [
                "sh",
                "-c",
                "id -u; id -g; cat /proc/self/uid_map; echo data > /written; "
                "stat -c '%u %g' / /etc/passwd /written /etc/hosts /dev/shm",
            ],
        )
        assert inside.exit_code == 0, inside.stderr
        lines = inside.stdout.decode().split("\n")
        assert lines[0:2] == ["0", "0"]
        assert lines[2].split() == ["0", str(HOST_BASE), str(SIZE)]
        # The image's files, the pod's files and /dev/shm all belong to the pod's root.
        assert lines[3:8] == ["0 0"] * 5

        # On the host the process and what it wrote belong to the mapped range.
        pid = _pid_of(daemon, container_id)
        assert _proc_ids(pid) == (HOST_BASE, HOST_BASE)
        written = daemon.root / "containers" / container_id / "upper" / "written"
        assert (written.stat().st_uid, written.stat().st_gid) == (HOST_BASE, HOST_BASE)
        # The image's layers themselves stay the host root's.
        layers = daemon.root / "images" / "layers"
        passwd = next(layers.glob("*/diff/etc/passwd"))
        assert passwd.stat().st_uid == 0
    assert daemon.leaks() == {}


def _pid_of(daemon: Daemon, container_id: str) -> int:
    row = daemon.rows("containers")
    return int(next(r["pid"] for r in row if r["id"] == container_id))


def test_the_pods_network_belongs_to_its_user_namespace(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "userns-net", short_tmp, **_userns()) as p:
        container_id = create(daemon, p, container_config("web", "exec sleep 300"))
        start(daemon, container_id)
        # Binding a port below 1024 needs CAP_NET_BIND_SERVICE over the network
        # namespace: the pod's root has it only if its user namespace owns the netns.
        bound = exec_sync(
            daemon, container_id, ["sh", "-c", "timeout 1 nc -l -p 80; test $? = 143"]
        )
        assert bound.exit_code == 0, bound.stderr
        # The pod is on the network, with its hostname set in its own UTS namespace.
        sandbox_id = p[0]
        pod_status = daemon.runtime().PodSandboxStatus(
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=10
        )
        assert ping(pod_status.status.network.ip)
        assert exec_sync(daemon, container_id, ["hostname"]).stdout == b"userns-net\n"
        # Seen from the host: the pinned netns is owned by the pinned user namespace.
        netns = os.open(daemon.run_root / "netns" / sandbox_id, os.O_RDONLY)
        try:
            owner = fcntl.ioctl(netns, NS_GET_USERNS)
            try:
                assert (
                    os.fstat(owner).st_ino
                    == (daemon.run_root / "userns" / sandbox_id).stat().st_ino
                )
            finally:
                os.close(owner)
        finally:
            os.close(netns)
    assert daemon.leaks() == {}


def test_a_volume_is_idmapped(daemon: Daemon, image: None, short_tmp: Path) -> None:
    volume = short_tmp / "volume"
    volume.mkdir()
    (volume / "owned-by-host-root").write_text("host\n")
    mount = api_pb2.Mount(container_path="/data", host_path=str(volume))
    with pod(daemon, "userns-vol", short_tmp, **_userns()) as p:
        final = run_to_exit(
            daemon,
            p,
            container_config(
                "writer",
                "stat -c '%u' /data/owned-by-host-root; echo from-pod > /data/new",
                mounts=[mount],
            ),
        )
        assert final.exit_code == 0
        assert output(final) == ["0"]
        # What the pod's root writes through the idmapped mount is the host's root's.
        new = volume / "new"
        assert new.read_text() == "from-pod\n"
        assert new.stat().st_uid == 0
    assert daemon.leaks() == {}


def test_two_pods_get_their_own_user_namespaces(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    other = HOST_BASE + SIZE
    with (
        pod(daemon, "first", short_tmp, **_userns()) as a,
        pod(daemon, "second", short_tmp, **_userns(other)) as b,
    ):
        maps = []
        for p in (a, b):
            final = run_to_exit(daemon, p, container_config("c", "cat /proc/self/uid_map"))
            maps.append(output(final)[0].split())
        assert maps == [["0", str(HOST_BASE), str(SIZE)], ["0", str(other), str(SIZE)]]
    assert daemon.leaks() == {}


def test_user_namespace_survives_a_daemon_restart(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "restarted", short_tmp, **_userns()) as p:
        daemon.restart()
        final = run_to_exit(daemon, p, container_config("after", "id -u; cat /proc/self/uid_map"))
        lines = output(final)
        assert lines[0] == "0" and lines[1].split()[1] == str(HOST_BASE)
    assert daemon.leaks() == {}


def test_a_shared_pid_namespace_in_a_user_namespace(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "shared", short_tmp, **_userns(pid=api_pb2.POD)) as p:
        config = container_config(
            "c",
            "exec sleep 300",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(
                    namespace_options=api_pb2.NamespaceOption(pid=api_pb2.POD)
                )
            ),
        )
        container_id = create(daemon, p, config)
        start(daemon, container_id)
        seen = exec_sync(daemon, container_id, ["cat", "/proc/1/cmdline"])
        assert seen.stdout == b"/pause\0"
    assert daemon.leaks() == {}


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"network": api_pb2.NODE}, "host's network"),
        ({"ipc": api_pb2.NODE}, "host's ipc"),
    ],
)
def test_host_namespaces_with_a_user_namespace_are_refused(
    daemon: Daemon, options: dict[str, int], words: str
) -> None:
    from tests.harness import pod_config

    config = pod_config("refused", uid="uid-refused", **_userns(**options))
    with pytest.raises(grpc.RpcError) as caught:
        run_pod(daemon, config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (caught.value.details() or "")
    assert daemon.leaks() == {}


def test_a_user_outside_the_mappings_is_refused(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "outside", short_tmp, **_userns()) as p:
        config = container_config(
            "c",
            "true",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(
                    run_as_user=api_pb2.Int64Value(value=SIZE + 5)
                )
            ),
        )
        with pytest.raises(grpc.RpcError) as caught:
            create(daemon, p, config)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the pod's user namespace" in (caught.value.details() or "")
        listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=10)
        assert list(listed.containers) == []
    assert daemon.leaks() == {}


def test_removing_a_container_leaves_no_idmapped_mounts(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    with pod(daemon, "removed", short_tmp, **_userns()) as p:
        container_id = create(daemon, p, container_config("c", "exec sleep 300"))
        start(daemon, container_id)
        staged = [
            line
            for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if "idmap" in line.split()[4] or "/mounts/" in line.split()[4]
        ]
        assert staged == []
        remove(daemon, container_id)
    assert daemon.leaks() == {}


def test_a_privileged_container_is_privileged_only_in_its_user_namespace(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    """kubelet allows privileged containers with hostUsers: false: all capabilities, over
    the pod's own namespaces only."""
    linux = userns_linux(HOST_BASE, SIZE)
    linux.security_context.privileged = True
    with pod(daemon, "privileged", short_tmp, linux=linux) as p:
        config = container_config(
            "admin",
            "id -u; ip link set lo mtu 9000 && echo net-admin; cat /proc/self/uid_map",
            linux=api_pb2.LinuxContainerConfig(
                security_context=api_pb2.LinuxContainerSecurityContext(privileged=True)
            ),
        )
        final = run_to_exit(daemon, p, config)
        assert final.exit_code == 0, output(final, "stderr")
        lines = output(final)
        assert lines[0:2] == ["0", "net-admin"]
        assert lines[2].split() == ["0", str(HOST_BASE), str(SIZE)]
    assert daemon.leaks() == {}
