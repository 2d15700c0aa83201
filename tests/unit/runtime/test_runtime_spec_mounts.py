"""build_spec: mounts (kernel filesystems, pod files, bind mounts) and devices."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from runtime_spec_inputs import container_config

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.spec import SandboxContext

SpecOf = Callable[..., dict[str, Any]]

# A mountinfo with / private, /shared shared and /slave a slave.
MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
30 22 0:40 / /shared rw shared:5 - tmpfs tmpfs rw
31 22 0:41 / /slave rw master:5 - tmpfs tmpfs rw
"""


def _by_destination(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["destination"]: m for m in spec["mounts"]}


def test_default_mounts(spec_of: SpecOf) -> None:
    mounts = _by_destination(spec_of())
    assert mounts["/proc"]["type"] == "proc"
    assert mounts["/dev"]["type"] == "tmpfs"
    assert mounts["/dev/pts"]["type"] == "devpts"
    assert mounts["/dev/shm"]["type"] == "tmpfs"
    assert mounts["/dev/mqueue"]["type"] == "mqueue"
    assert mounts["/sys"]["type"] == "sysfs" and "ro" in mounts["/sys"]["options"]
    cgroup = mounts["/sys/fs/cgroup"]
    assert cgroup["type"] == "cgroup" and "ro" in cgroup["options"]
    # A pod without files of its own gets none of /etc/{resolv.conf,hostname,hosts}.
    assert not {"/etc/resolv.conf", "/etc/hostname", "/etc/hosts"} & set(mounts)


def test_privileged_gets_writable_sys(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = True
    mounts = _by_destination(spec_of(cfg, sandbox=SandboxContext(pod_id="p", privileged=True)))
    assert "ro" not in mounts["/sys"]["options"]
    assert "ro" not in mounts["/sys/fs/cgroup"]["options"]


@pytest.mark.parametrize("readonly_rootfs", [False, True])
def test_pod_files_and_shm_are_bind_mounted(
    spec_of: SpecOf, tmp_path: Path, readonly_rootfs: bool
) -> None:
    sandbox = SandboxContext(
        pod_id="p",
        resolv_conf_path=tmp_path / "resolv.conf",
        hostname_path=tmp_path / "hostname",
        hosts_path=tmp_path / "hosts",
        shm_path=tmp_path / "shm",
    )
    cfg = container_config()
    cfg.linux.security_context.readonly_rootfs = readonly_rootfs
    mounts = _by_destination(spec_of(cfg, sandbox=sandbox))
    for destination, name in [
        ("/etc/resolv.conf", "resolv.conf"),
        ("/etc/hostname", "hostname"),
        ("/etc/hosts", "hosts"),
    ]:
        assert mounts[destination]["type"] == "bind"
        assert mounts[destination]["source"] == str(tmp_path / name)
        assert "rbind" in mounts[destination]["options"]
        # Writable unless the whole rootfs is read-only, as in containerd.
        assert ("ro" in mounts[destination]["options"]) is readonly_rootfs
    assert mounts["/dev/shm"]["type"] == "bind"
    assert mounts["/dev/shm"]["source"] == str(tmp_path / "shm")


@pytest.mark.parametrize(
    ("propagation", "option"),
    [
        (api_pb2.PROPAGATION_PRIVATE, "rprivate"),
        (api_pb2.PROPAGATION_HOST_TO_CONTAINER, "rslave"),
        (api_pb2.PROPAGATION_BIDIRECTIONAL, "rshared"),
    ],
)
@pytest.mark.parametrize("readonly", [False, True])
def test_bind_mount_options(
    spec_of: SpecOf, tmp_path: Path, propagation: int, option: str, readonly: bool
) -> None:
    (tmp_path / "shared" / "data").mkdir(parents=True)
    source = tmp_path / "shared" / "data"
    cfg = container_config(
        mounts=[
            api_pb2.Mount(
                container_path="/data",
                host_path=str(source),
                readonly=readonly,
                propagation=propagation,
            )
        ]
    )
    info = MOUNTINFO.replace("/shared", str(tmp_path / "shared"))
    spec = spec_of(cfg, mountinfo=lambda: info)
    mount = _by_destination(spec)["/data"]
    assert mount["type"] == "bind" and mount["source"] == str(source)
    assert mount["options"] == ["rbind", option, *(["ro"] if readonly else [])]
    # The rootfs must propagate too, or events stop at the container's root.
    expected_root = {"rprivate": None, "rslave": "rslave", "rshared": "rshared"}[option]
    assert spec["linux"].get("rootfsPropagation") == expected_root


@pytest.mark.parametrize(
    ("propagation", "mount_point", "ok"),
    [
        (api_pb2.PROPAGATION_BIDIRECTIONAL, "/", False),  # / is private here
        (api_pb2.PROPAGATION_BIDIRECTIONAL, "/slave", False),
        (api_pb2.PROPAGATION_HOST_TO_CONTAINER, "/", False),
        (api_pb2.PROPAGATION_HOST_TO_CONTAINER, "/slave", True),
        (api_pb2.PROPAGATION_HOST_TO_CONTAINER, "/shared", True),
    ],
)
def test_propagation_needs_a_matching_host_mount(
    spec_of: SpecOf, tmp_path: Path, propagation: int, mount_point: str, ok: bool
) -> None:
    source = tmp_path / "vol"
    source.mkdir()
    # Put the host path below the mount point under test.
    info = (
        MOUNTINFO.replace(f" {mount_point} ", f" {tmp_path} ") if mount_point != "/" else MOUNTINFO
    )
    cfg = container_config(
        mounts=[api_pb2.Mount(container_path="/v", host_path=str(source), propagation=propagation)]
    )
    if ok:
        spec_of(cfg, mountinfo=lambda: info)
    else:
        with pytest.raises(InvalidArgument, match=r"mounts\[0\]\.propagation"):
            spec_of(cfg, mountinfo=lambda: info)


@pytest.mark.parametrize(
    ("container_path", "host_path", "message"),
    [
        ("/data", "relative/dir", r"mounts\[0\]\.host_path: 'relative/dir' must be an absolute"),
        ("/data", "/does/not/exist", r"mounts\[0\]\.host_path: /does/not/exist does not exist"),
        ("data", "/tmp", r"mounts\[0\]\.container_path"),
    ],
)
def test_bad_mounts_are_invalid(
    spec_of: SpecOf, container_path: str, host_path: str, message: str
) -> None:
    cfg = container_config(
        mounts=[api_pb2.Mount(container_path=container_path, host_path=host_path)]
    )
    with pytest.raises(InvalidArgument, match=message):
        spec_of(cfg)


def test_request_mount_replaces_the_default_at_the_same_path(
    spec_of: SpecOf, tmp_path: Path
) -> None:
    kubelet_hosts = tmp_path / "etc-hosts"
    kubelet_hosts.write_text("127.0.0.1 localhost\n")
    sandbox = SandboxContext(pod_id="p", hosts_path=tmp_path / "pod-hosts")
    cfg = container_config(
        mounts=[
            api_pb2.Mount(container_path="/etc/hosts", host_path=str(kubelet_hosts)),
            api_pb2.Mount(container_path="/dev/shm/", host_path=str(tmp_path)),
        ]
    )
    mounts = spec_of(cfg, sandbox=sandbox)["mounts"]
    hosts = [m for m in mounts if m["destination"] == "/etc/hosts"]
    assert [m["source"] for m in hosts] == [str(kubelet_hosts)]
    assert [m["type"] for m in mounts if m["destination"].rstrip("/") == "/dev/shm"] == ["bind"]


def test_request_mounts_are_ordered_parents_first(spec_of: SpecOf, tmp_path: Path) -> None:
    cfg = container_config(
        mounts=[
            api_pb2.Mount(container_path="/a/b/c", host_path=str(tmp_path)),
            api_pb2.Mount(container_path="/a", host_path=str(tmp_path)),
            api_pb2.Mount(container_path="/a/b", host_path=str(tmp_path)),
        ]
    )
    destinations = [m["destination"] for m in spec_of(cfg)["mounts"]]
    assert destinations[-3:] == ["/a", "/a/b", "/a/b/c"]


def test_unsupported_mount_features_are_refused(spec_of: SpecOf, tmp_path: Path) -> None:
    cfg = container_config(
        mounts=[
            api_pb2.Mount(container_path="/d", host_path=str(tmp_path), recursive_read_only=True)
        ]
    )
    with pytest.raises(InvalidArgument, match="recursive_read_only"):
        spec_of(cfg)


# ---- devices --------------------------------------------------------------------------


def test_device_is_created_and_allowed(spec_of: SpecOf) -> None:
    cfg = container_config(
        devices=[
            api_pb2.Device(container_path="/dev/mynull", host_path="/dev/null", permissions="rw")
        ]
    )
    spec = spec_of(cfg)
    info = os.stat("/dev/null")
    assert spec["linux"]["devices"] == [
        {
            "path": "/dev/mynull",
            "type": "c",
            "major": os.major(info.st_rdev),
            "minor": os.minor(info.st_rdev),
            "fileMode": 0o666,
            "uid": 0,
            "gid": 0,
        }
    ]
    rules = spec["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}  # deny by default
    assert rules[1] == {
        "allow": True,
        "type": "c",
        "major": os.major(info.st_rdev),
        "minor": os.minor(info.st_rdev),
        "access": "rw",
    }


@pytest.mark.parametrize(
    ("host_path", "permissions", "message"),
    [
        ("/dev/nonexistent-device", "rwm", "does not exist"),
        ("/etc/hostname", "rwm", "is not a device"),
        ("/dev/null", "rwx", "permissions"),
        ("dev/null", "r", "must be absolute"),
    ],
)
def test_bad_devices_are_invalid(
    spec_of: SpecOf, host_path: str, permissions: str, message: str
) -> None:
    cfg = container_config(
        devices=[
            api_pb2.Device(container_path="/dev/x", host_path=host_path, permissions=permissions)
        ]
    )
    with pytest.raises(InvalidArgument, match=rf"devices\[0\].*{message}"):
        spec_of(cfg)


def test_privileged_gets_every_host_device(spec_of: SpecOf) -> None:
    cfg = container_config()
    cfg.linux.security_context.privileged = True
    spec = spec_of(cfg, sandbox=SandboxContext(pod_id="p", privileged=True))
    paths = {d["path"] for d in spec["linux"]["devices"]}
    assert {"/dev/null", "/dev/zero"} <= paths
    assert not any(p.startswith("/dev/pts/") for p in paths)
    assert spec["linux"]["resources"]["devices"] == [{"allow": True, "access": "rwm"}]
