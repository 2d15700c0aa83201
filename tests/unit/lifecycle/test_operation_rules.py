"""The rules each operation enforces before it makes or changes anything: a pod's
sysctls (pod_rules.py), resources within the kernel's ranges and the CPUs online
(lifecycle/resource_rules.py), a mount's host path (lifecycle/container_rules.py), a
cgroup parent each driver can name (runtime/cgroup_driver.py, with the edge's shape of it).
Each is refused with INVALID_ARGUMENT naming the field, and no name is reserved for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.host import mounts
from cri_shim.lifecycle.container_rules import check_container
from cri_shim.lifecycle.pod_resources import PodResources
from cri_shim.lifecycle.resource_rules import check_pod_resources, check_resources
from cri_shim.pod_rules import check_pod_sysctls
from cri_shim.runtime.cgroup_driver import CGROUPFS_DRIVER, SYSTEMD_DRIVER
from cri_shim.server.validation import validate_request
from cri_shim.state.records import SandboxRecord
from tests.unit.lifecycle.test_lifecycle_seams import _containers, _sandboxes
from tests.unit.test_cpusets import host_with_two_cpus

HOST_NET = api_pb2.NamespaceOption(network=api_pb2.NODE)
HOST_IPC = api_pb2.NamespaceOption(ipc=api_pb2.NODE)


def pod(
    sysctls: dict[str, str], options: api_pb2.NamespaceOption | None = None
) -> api_pb2.PodSandboxConfig:
    config = api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(name="web", namespace="default", uid="u1")
    )
    config.linux.sysctls.update(sysctls)
    if options is not None:
        config.linux.security_context.namespace_options.CopyFrom(options)
    return config


@pytest.mark.parametrize(
    ("sysctls", "options", "why"),
    [
        ({"kernel.panic": "1"}, None, "kernel.panic is not a namespaced sysctl"),
        ({"net.ipv4.ip_forward": "1"}, HOST_NET, "cannot be set in a pod on the host network"),
        ({"kernel.shmmax": "1"}, HOST_IPC, "cannot be set in a pod with host IPC"),
    ],
)
def test_a_pod_may_set_only_the_sysctls_its_namespaces_isolate(
    sysctls: dict[str, str], options: api_pb2.NamespaceOption | None, why: str
) -> None:
    with pytest.raises(InvalidArgument, match=f"^PodSandboxConfig.linux.sysctls: .*{why}"):
        check_pod_sysctls(pod(sysctls, options))


def test_namespaced_sysctls_are_accepted() -> None:
    check_pod_sysctls(pod({"net.ipv4.ip_unprivileged_port_start": "0", "kernel.sem": "1 2 3 4"}))
    check_pod_sysctls(pod({"net/ipv4/conf/eth0.100/rp_filter": "1"}))
    check_pod_sysctls(pod({"kernel.shmmax": "1"}, HOST_NET))  # IPC stays the pod's own


# cgroup parents of each driver's form that the driver cannot take as they are: the
# systemd ones would become a cgroupsPath the runtime splits wrongly (`a:b.slice:cri-shim:ID`)
# or a unit systemd refuses, the cgroupfs ones a cgroup whose name breaks the lines of
# /proc/<pid>/cgroup.
UNNAMEABLE_PARENTS = {
    "systemd": [
        "/kubepods.slice/a:b.slice",
        "kubepods-a:b.slice",
        "/kubepods.slice/kubepods-besteffort pod1.slice",
        "kubepods-pod\t1.slice",
        "kubepods-pod\x1b1.slice",
        "kubepods-p\u00f6d1.slice",
        "k" * 300 + ".slice",
    ],
    "cgroupfs": [
        "/kubepods/besteffort/pod 1",
        "/kubepods/besteffort/pod1\n0::/elsewhere",
        "/kubepods/besteffort/pod\x7f1",
        "/kubepods/besteffort/pod\u20281",
    ],
}


@pytest.mark.parametrize(
    ("driver", "parent"),
    [(driver, parent) for driver, parents in UNNAMEABLE_PARENTS.items() for parent in parents],
)
async def test_run_pod_sandbox_refuses_a_cgroup_parent_its_driver_cannot_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str, parent: str
) -> None:
    def no_mount(*args: object, **kwargs: object) -> None:
        # A creation that got this far (the check gone) mounts nothing its fake undo
        # actions would leave mounted.
        raise AssertionError("the pod's creation went on to mount its /dev/shm")

    monkeypatch.setattr(mounts, "mount_tmpfs", no_mount)
    sandboxes, _bus = _sandboxes(tmp_path, [], cgroup_manager=driver)
    config = pod({})
    config.linux.cgroup_parent = parent
    with pytest.raises(InvalidArgument, match=r"^PodSandboxConfig\.linux\.cgroup_parent: "):
        # As the daemon serves it: the edge's check of the field, then the operation's.
        validate_request("RunPodSandbox", api_pb2.RunPodSandboxRequest(config=config))
        await sandboxes.run(config, "", None)
    assert sandboxes.rows.ids() == set()
    assert sandboxes.rows._db.query("SELECT name FROM names") == []
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").rglob("*"))


@pytest.mark.parametrize(
    ("driver", "parent"),
    [
        ("systemd", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice"),
        ("systemd", "kubepods-burstable-pod0a1b.slice"),
        ("systemd", "/test.slice"),
        ("systemd", "a\\x2db.slice"),
        ("cgroupfs", "/kubepods/besteffort/pod0a1b2c3d-0000-4000-8000-00000000cafe"),
        ("cgroupfs", "/kubepods/pod:1"),
    ],
)
def test_the_parents_kubelet_and_critest_send_are_accepted(driver: str, parent: str) -> None:
    config = pod({})
    config.linux.cgroup_parent = parent
    validate_request("RunPodSandbox", api_pb2.RunPodSandboxRequest(config=config))
    driver_of = {"systemd": SYSTEMD_DRIVER, "cgroupfs": CGROUPFS_DRIVER}[driver]
    driver_of.check_parent(parent)


async def test_run_pod_sandbox_refuses_a_node_wide_sysctl_before_reserving_a_name(
    tmp_path: Path,
) -> None:
    sandboxes, _bus = _sandboxes(tmp_path, [])
    with pytest.raises(InvalidArgument, match=r"linux\.sysctls: kernel\.panic"):
        await sandboxes.run(pod({"kernel.panic": "1"}), "", None)
    assert sandboxes.rows.ids() == set()
    assert sandboxes.rows._db.query("SELECT name FROM names") == []


@pytest.mark.parametrize(
    ("resources", "named"),
    [
        (api_pb2.LinuxContainerResources(cpu_period=2), "cpu_period: 2 is not in 1000..1000000"),
        (api_pb2.LinuxContainerResources(cpu_shares=1), "cpu_shares: 1 is not in 2..262144"),
        (api_pb2.LinuxContainerResources(cpu_quota=1), "cpu_quota: 1 is below 1000"),
        (
            api_pb2.LinuxContainerResources(
                memory_limit_in_bytes=1 << 30, memory_swap_limit_in_bytes=1 << 20
            ),
            "memory_swap_limit_in_bytes",
        ),
        (api_pb2.LinuxContainerResources(oom_score_adj=1001), "oom_score_adj"),
        (api_pb2.LinuxContainerResources(cpuset_cpus="0-3; echo"), "cpuset_cpus"),
    ],
)
def test_resources_the_kernel_would_refuse_are_named(
    resources: api_pb2.LinuxContainerResources, named: str
) -> None:
    with pytest.raises(InvalidArgument, match=f"^r\\.{re.escape(named)}"):
        check_resources(resources, "r")
    check_resources(
        api_pb2.LinuxContainerResources(cpu_period=100_000, cpu_quota=50_000, cpu_shares=2), "r"
    )


async def test_update_container_resources_refuses_them_before_it_looks_for_the_container(
    tmp_path: Path,
) -> None:
    containers, _bus, _backend = _containers(tmp_path, [])
    with pytest.raises(
        InvalidArgument, match=r"^UpdateContainerResourcesRequest\.linux\.cpu_quota"
    ):
        await containers.update_resources("nobody", api_pb2.LinuxContainerResources(cpu_quota=1))


def test_pod_level_cpusets_are_held_to_the_hosts_cpus_and_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_with_two_cpus(tmp_path, monkeypatch)
    too_many = api_pb2.LinuxContainerResources(cpuset_cpus="0-8000000")
    with pytest.raises(InvalidArgument) as refused:
        check_pod_resources(None, too_many, "UpdatePodSandboxResourcesRequest")
    assert str(refused.value) == (
        "UpdatePodSandboxResourcesRequest.resources.cpuset_cpus: CPU 2 is not online on this "
        "host (online: 0-1)"
    )
    node_one = api_pb2.LinuxContainerResources(cpuset_mems="1")
    with pytest.raises(InvalidArgument, match=r"^PodSandboxConfig\.linux\.overhead\.cpuset_mems: "):
        check_pod_resources(node_one, None, "PodSandboxConfig.linux")
    check_pod_resources(None, api_pb2.LinuxContainerResources(cpuset_cpus="1"), "r")


async def test_update_pod_sandbox_resources_refuses_a_cpu_not_online(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host_with_two_cpus(tmp_path, monkeypatch)

    def sandbox_of(ref: str) -> SandboxRecord:
        raise AssertionError("looked the pod up before checking the request")

    resize = PodResources(sandbox_of)
    with pytest.raises(InvalidArgument, match=r"resources\.cpuset_cpus: CPU 2 is not online"):
        await resize.update("p", None, api_pb2.LinuxContainerResources(cpuset_cpus="0-2"))


def container(*mounts: api_pb2.Mount) -> api_pb2.ContainerConfig:
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="app"),
        image=api_pb2.ImageSpec(image="busybox"),
        mounts=mounts,
    )


def test_a_missing_host_path_is_made_a_directory_as_containerd_does(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    check_container(
        container(
            api_pb2.Mount(container_path="/a", host_path="/tmp"),
            api_pb2.Mount(container_path="/d", host_path=str(missing)),
        )
    )
    assert missing.is_dir()
    assert missing.stat().st_mode & 0o777 == 0o755


def test_a_host_path_that_cannot_be_made_is_refused_naming_the_mount(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "x")
    for name, reason in (("file/below", "Not a directory"), ("dangling", "cannot be made")):
        with pytest.raises(
            InvalidArgument, match=rf"^ContainerConfig\.mounts\[1\]\.host_path: .*{reason}"
        ):
            check_container(
                container(
                    api_pb2.Mount(container_path="/a", host_path="/tmp"),
                    api_pb2.Mount(container_path="/d", host_path=str(tmp_path / name)),
                )
            )


def test_a_symlinked_host_path_is_accepted_as_kubelet_expects(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    check_container(
        container(api_pb2.Mount(container_path="/data", host_path=str(tmp_path / "link")))
    )


def test_an_image_volume_has_no_host_path_to_check() -> None:
    volume = api_pb2.Mount(container_path="/data", image=api_pb2.ImageSpec(image="busybox"))
    check_container(container(volume))


def test_a_containers_resources_are_checked_with_its_mounts() -> None:
    config = container()
    config.linux.resources.cpu_period = 5
    with pytest.raises(InvalidArgument, match=r"^ContainerConfig\.linux\.resources\.cpu_period"):
        check_container(config)


async def test_create_container_refuses_a_host_path_it_cannot_make_before_reserving_a_name(
    tmp_path: Path,
) -> None:
    containers, _bus, _backend = _containers(tmp_path, [])
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "x")
    missing = api_pb2.Mount(container_path="/d", host_path=str(tmp_path / "dangling"))
    with pytest.raises(InvalidArgument, match=r"mounts\[0\]\.host_path"):
        await containers.create("no-such-pod", container(missing), None)
