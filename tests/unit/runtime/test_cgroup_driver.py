"""The cgroup drivers as pure functions: systemd's slice naming, the cgroupsPath each
driver gives, the directory either form resolves to, the refusal of a parent of the other
driver's form, and the start's choice of driver."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.config import ConfigError
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.cgroup_driver import (
    CGROUPFS_DRIVER,
    SYSTEMD_DRIVER,
    cgroup_dir,
    driver_named,
    expand_slice,
    resolve_cgroup_manager,
    scope_unit,
    systemd_booted,
)
from cri_shim.runtime.spec import SandboxContext

POD_SLICE = "kubepods-besteffort-pod0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0.slice"


@pytest.mark.parametrize(
    ("name", "expanded"),
    [
        ("-.slice", "/"),
        ("system.slice", "/system.slice"),
        ("kubepods.slice", "/kubepods.slice"),
        (
            POD_SLICE,
            "/kubepods.slice/kubepods-besteffort.slice/" + POD_SLICE,
        ),
        ("a-b-c-d.slice", "/a.slice/a-b.slice/a-b-c.slice/a-b-c-d.slice"),
    ],
)
def test_a_slice_expands_to_its_nested_directories(name: str, expanded: str) -> None:
    assert expand_slice(name) == expanded


@pytest.mark.parametrize(
    "name",
    ["kubepods", "/kubepods.slice", "a/b.slice", ".slice", "-a.slice", "a-.slice", "a--b.slice"],
)
def test_what_systemd_would_refuse_as_a_slice_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="slice name"):
        expand_slice(name)


def test_systemd_gives_slice_prefix_name_and_resolves_it_to_the_scope() -> None:
    path = SYSTEMD_DRIVER.cgroups_path(POD_SLICE, "c1")
    assert path == f"{POD_SLICE}:cri-shim:c1"
    assert scope_unit(path) == "cri-shim-c1.scope"
    assert cgroup_dir(path) == (
        f"/kubepods.slice/kubepods-besteffort.slice/{POD_SLICE}/cri-shim-c1.scope"
    )


@pytest.mark.parametrize(
    ("parent", "slice_name"),
    [
        # kubelet sends the slice expanded into its path; critest sends /test.slice.
        (
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice",
            "kubepods-besteffort-pod1.slice",
        ),
        ("/test.slice", "test.slice"),
        ("test.slice", "test.slice"),
    ],
)
def test_systemd_takes_the_slice_a_parent_path_ends_in(parent: str, slice_name: str) -> None:
    path = SYSTEMD_DRIVER.cgroups_path(parent, "c1")
    assert path == f"{slice_name}:cri-shim:c1"
    assert cgroup_dir(path) == f"{expand_slice(slice_name)}/cri-shim-c1.scope"


def test_systemd_without_a_parent_uses_system_slice() -> None:
    path = SYSTEMD_DRIVER.cgroups_path("", "c1")
    assert path == "system.slice:cri-shim:c1"
    assert cgroup_dir(path) == "/system.slice/cri-shim-c1.scope"


def test_cgroupfs_paths_resolve_to_themselves() -> None:
    path = CGROUPFS_DRIVER.cgroups_path("/kubepods/besteffort/pod1", "c1")
    assert path == "/kubepods/besteffort/pod1/cri-shim-c1"
    assert cgroup_dir(path) == path
    assert cgroup_dir("") == ""


def test_the_drivers_options_and_answers() -> None:
    assert SYSTEMD_DRIVER.runtime_args == ("--systemd-cgroup",)
    assert CGROUPFS_DRIVER.runtime_args == ()
    assert SYSTEMD_DRIVER.cri_driver == api_pb2.SYSTEMD
    assert CGROUPFS_DRIVER.cri_driver == api_pb2.CGROUPFS


@pytest.mark.parametrize(
    "parent", ["/kubepods/besteffort/pod1", "/kubepods.slice/pod1", "kubepods"]
)
def test_systemd_refuses_a_cgroupfs_parent_naming_both_sides(parent: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        SYSTEMD_DRIVER.cgroups_path(parent, "c1")
    message = str(info.value)
    assert message.startswith("cgroup_parent:") and "cgroupfs path" in message
    assert 'cgroup_manager = "systemd"' in message and "--cgroup-driver=systemd" in message


def test_cgroupfs_refuses_a_slice_parent_naming_both_sides() -> None:
    with pytest.raises(InvalidArgument) as info:
        CGROUPFS_DRIVER.check_parent(POD_SLICE, "PodSandboxConfig.linux.cgroup_parent")
    message = str(info.value)
    assert message.startswith("PodSandboxConfig.linux.cgroup_parent:")
    assert "kubelet runs the systemd cgroup driver" in message
    assert 'cgroup_manager = "cgroupfs"' in message and "--cgroup-driver=cgroupfs" in message


def test_a_spec_under_systemd_names_the_scope(spec_of: Callable[..., dict[str, Any]]) -> None:
    sandbox = SandboxContext(pod_id="p", cgroup_parent=POD_SLICE, cgroup_driver=SYSTEMD_DRIVER)
    spec = spec_of(sandbox=sandbox)
    assert spec["linux"]["cgroupsPath"].startswith(f"{POD_SLICE}:cri-shim:")


@pytest.mark.parametrize(
    ("configured", "systemd_running", "resolved"),
    [
        ("auto", True, "systemd"),
        ("auto", False, "cgroupfs"),
        ("cgroupfs", True, "cgroupfs"),
        ("systemd", True, "systemd"),
    ],
)
def test_auto_follows_the_host(configured: str, systemd_running: bool, resolved: str) -> None:
    assert resolve_cgroup_manager(configured, systemd_running=systemd_running) == resolved


def test_systemd_on_a_host_without_systemd_stops_the_start() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_cgroup_manager("systemd", systemd_running=False)
    message = str(info.value)
    assert message.startswith('cgroup_manager: "systemd" is configured, but systemd does not run')
    assert "/run/systemd/system" in message


def test_conmon_cgroup_under_cgroupfs_stops_the_start() -> None:
    with pytest.raises(ConfigError, match=r"^conmon_cgroup: 'pod' is set, but the cgroup driver"):
        resolve_cgroup_manager("auto", systemd_running=False, conmon_cgroup="pod")
    assert resolve_cgroup_manager("auto", systemd_running=True, conmon_cgroup="pod") == "systemd"


def test_systemd_is_booted_when_its_run_directory_exists(tmp_path: Path) -> None:
    assert not systemd_booted(tmp_path / "system")
    (tmp_path / "system").mkdir()
    assert systemd_booted(tmp_path / "system")
    assert driver_named("systemd") is SYSTEMD_DRIVER
    assert driver_named("cgroupfs") is CGROUPFS_DRIVER
