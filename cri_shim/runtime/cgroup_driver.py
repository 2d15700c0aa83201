"""The cgroup driver: who creates a container's cgroup, and how the spec names it.

- `cgroupfs`: kubelet's `cgroup_parent` is a path (`/kubepods/besteffort/pod<uid>`); a
  container's cgroup is `<parent>/cri-shim-<id>`, made by the runtime in the file system.
- `systemd`: kubelet's `cgroup_parent` is a slice (`kubepods-besteffort-pod<uid>.slice`);
  a container's OCI `cgroupsPath` is `slice:cri-shim:<id>`, and the runtime, given its
  global `--systemd-cgroup`, asks systemd for the scope `cri-shim-<id>.scope` in that
  slice. conmon goes into a transient scope of its own (runtime/conmon_scope.py).

Both drivers run on either cgroup layout (v1, v2); the layout only changes which files
hold a figure (runtime/stats.py, runtime/cgroup_metrics.py). Every reader and writer of a
container's cgroup files goes through `cgroup_dir`, which resolves either form of
`cgroupsPath` to the directory below each hierarchy's root: a container made under one
driver stays readable after the daemon restarts with the other.

With both sides running a driver of their own, a node has two cgroup managers: kubelet
(told the driver by RuntimeConfig) and the runtime must agree, so a `cgroup_parent` of the
other driver's form is refused, naming both sides; and so is a slice that systemd could not
name, or that a cgroupsPath could only misread (below).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from cri_shim.api.v1 import api_pb2
from cri_shim.config.model import ConfigError
from cri_shim.errors import InvalidArgument

CGROUPFS = "cgroupfs"
SYSTEMD = "systemd"
# The default: systemd where systemd runs the host (as CRI-O and kubeadm expect there).
AUTO = "auto"
CGROUP_MANAGERS = (AUTO, CGROUPFS, SYSTEMD)

# sd_booted()'s test: systemd is PID 1 (and its D-Bus API is there) when this exists.
SYSTEMD_RUN_DIR = Path("/run/systemd/system")
# The prefix of every scope the runtime asks systemd for (CRI-O's is `crio`).
SCOPE_PREFIX = "cri-shim"
# Where a container goes when kubelet gives no parent (CRI-O's choice too).
DEFAULT_SYSTEMD_PARENT = "system.slice"
# What a systemd-driver `cgroup_parent` may hold: systemd's unit-name characters
# (unit_name_is_valid: letters, digits and ":-_.\\"), and '/' between the slices kubelet
# expands it into; but not ':', which separates a cgroupsPath's slice from its prefix
# and name (`slice:prefix:name`): the runtime splits on it, and is_systemd_path reads a
# path with more than two as cgroupfs's, so a slice holding one is refused, never
# reinterpreted. The slice's name is systemd's at most (UNIT_NAME_MAX, less its NUL).
SLICE_CHARACTERS = re.compile(r"[A-Za-z0-9_.\\/-]*")
UNIT_NAME_MAX = 255


def systemd_booted(run_dir: Path = SYSTEMD_RUN_DIR) -> bool:
    return run_dir.is_dir()


def resolve_cgroup_manager(
    configured: str, *, systemd_running: bool, conmon_cgroup: str = ""
) -> str:
    """The driver the daemon runs with: `auto` is systemd on a host that systemd runs,
    cgroupfs elsewhere. A systemd driver without systemd stops the start, and so does a
    `conmon_cgroup` that the cgroupfs driver has no use for."""
    if configured == AUTO:
        configured = SYSTEMD if systemd_running else CGROUPFS
    if configured == CGROUPFS and conmon_cgroup:
        raise ConfigError(
            f"conmon_cgroup: {conmon_cgroup!r} is set, but the cgroup driver is cgroupfs "
            "(conmon stays in the daemon's cgroup): remove it, or use the systemd driver"
        )
    if configured == SYSTEMD and not systemd_running:
        raise ConfigError(
            'cgroup_manager: "systemd" is configured, but systemd does not run this host '
            f'(PID 1 is not systemd: no {SYSTEMD_RUN_DIR}); use "cgroupfs" (and kubelet\'s '
            '--cgroup-driver=cgroupfs) or "auto"'
        )
    return configured


def expand_slice(name: str) -> str:
    """A slice's directory below the hierarchy's root, per systemd's naming: each dash
    nests, so `kubepods-besteffort-pod1.slice` is
    `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice`, and `-.slice`
    is the root. ValueError for a name systemd would refuse as a slice."""
    if not name.endswith(".slice") or "/" in name:
        raise ValueError(f"{name!r} is not a slice name (`<name>.slice`, no '/')")
    if name == "-.slice":
        return "/"
    stem = name.removesuffix(".slice")
    if not stem or stem.startswith("-") or stem.endswith("-") or "--" in stem:
        raise ValueError(f"{name!r} is not a valid slice name (empty or doubled '-')")
    path, prefix = "", ""
    for part in stem.split("-"):
        prefix = f"{prefix}-{part}" if prefix else part
        path += f"/{prefix}.slice"
    return path


def parent_slice(cgroup_parent: str) -> str:
    """The slice a systemd-driver `cgroup_parent` names: kubelet sends the slice expanded
    into its path (`/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice`),
    critest `/test.slice`, others the bare name; as containerd and CRI-O do, the last
    component is the slice."""
    return cgroup_parent.rstrip("/").rsplit("/", 1)[-1]


def is_systemd_path(cgroups_path: str) -> bool:
    """Whether an OCI cgroupsPath is systemd's `slice:prefix:name`."""
    return cgroups_path.count(":") == 2 and "/" not in cgroups_path


def scope_unit(cgroups_path: str) -> str:
    """The unit systemd runs a container in, for a `slice:prefix:name` cgroupsPath (the
    name runc gives it: a slice named as one, else `<prefix>-<name>.scope`)."""
    _slice, prefix, name = cgroups_path.split(":")
    if name.endswith(".slice"):
        return name
    return f"{prefix}-{name}.scope" if prefix else f"{name}.scope"


def cgroup_dir(cgroups_path: str) -> str:
    """The container's cgroup below each hierarchy's root, for either driver's form of
    cgroupsPath ("" for none or a form neither driver writes)."""
    if not is_systemd_path(cgroups_path):
        return cgroups_path
    parent = cgroups_path.split(":")[0] or DEFAULT_SYSTEMD_PARENT
    try:
        slice_dir = expand_slice(parent)
    except ValueError:
        return ""
    return f"{slice_dir.rstrip('/')}/{scope_unit(cgroups_path)}"


def slice_of(cgroups_path: str) -> str:
    """The slice of a `slice:prefix:name` cgroupsPath."""
    return cgroups_path.split(":")[0] or DEFAULT_SYSTEMD_PARENT


@dataclass(frozen=True)
class CgroupDriver:
    """One driver: the cgroupsPath it gives a container, the runtime's global options
    that go with it, and what RuntimeConfig tells kubelet."""

    name: str

    @property
    def systemd(self) -> bool:
        return self.name == SYSTEMD

    @property
    def cri_driver(self) -> api_pb2.CgroupDriver.ValueType:
        return api_pb2.SYSTEMD if self.systemd else api_pb2.CGROUPFS

    @property
    def runtime_args(self) -> tuple[str, ...]:
        """Global options of runc, crun and runsc: with systemd's driver they ask
        systemd for the container's scope (and read it back from their state after)."""
        return ("--systemd-cgroup",) if self.systemd else ()

    def check_parent(self, cgroup_parent: str, field: str = "cgroup_parent") -> None:
        """Refuse a parent of the other driver's form, naming both sides."""
        if not cgroup_parent:
            return
        if self.systemd and not parent_slice(cgroup_parent).endswith(".slice"):
            raise InvalidArgument(
                f"{field}: {cgroup_parent!r} is a cgroupfs path, but this runtime's cgroup "
                'driver is systemd (cgroup_manager = "systemd"): run kubelet with '
                '--cgroup-driver=systemd, or set cgroup_manager = "cgroupfs"'
            )
        if self.systemd:
            _check_slice_characters(cgroup_parent, field)
            try:
                expand_slice(parent_slice(cgroup_parent))
            except ValueError as err:
                raise InvalidArgument(f"{field}: {err}") from None
        elif not cgroup_parent.startswith("/") or cgroup_parent.endswith(".slice"):
            raise InvalidArgument(
                f"{field}: {cgroup_parent!r} is not a cgroupfs path (kubelet runs the "
                "systemd cgroup driver, this runtime cgroupfs: cgroup_manager = "
                '"cgroupfs"); run kubelet with --cgroup-driver=cgroupfs, or set '
                'cgroup_manager = "systemd"'
            )

    def cgroups_path(self, cgroup_parent: str, container_id: str) -> str:
        """The OCI cgroupsPath of a container in a pod with this `cgroup_parent`."""
        self.check_parent(cgroup_parent)
        if self.systemd:
            parent = parent_slice(cgroup_parent) or DEFAULT_SYSTEMD_PARENT
            return f"{parent}:{SCOPE_PREFIX}:{container_id}"
        if not cgroup_parent:
            return f"/cri-shim/{container_id}"
        return f"{cgroup_parent.rstrip('/')}/cri-shim-{container_id}"


def _check_slice_characters(cgroup_parent: str, field: str) -> None:
    if not SLICE_CHARACTERS.fullmatch(cgroup_parent):
        bad = next(c for c in cgroup_parent if not SLICE_CHARACTERS.fullmatch(c))
        raise InvalidArgument(
            f"{field}: {cgroup_parent!r} holds {bad!r}, which a slice's name cannot under "
            "the systemd cgroup driver (letters, digits and '_.-\\' only; ':' separates the "
            "slice from the container's scope in the runtime's cgroupsPath)"
        )
    if len(parent_slice(cgroup_parent)) > UNIT_NAME_MAX:
        raise InvalidArgument(
            f"{field}: the slice's name is longer than systemd's {UNIT_NAME_MAX} characters"
        )


CGROUPFS_DRIVER = CgroupDriver(CGROUPFS)
SYSTEMD_DRIVER = CgroupDriver(SYSTEMD)


def driver_named(name: str) -> CgroupDriver:
    """The driver of a `cgroup_manager` (the daemon's is resolved at its start)."""
    if name == AUTO:
        name = SYSTEMD if systemd_booted() else CGROUPFS
    return SYSTEMD_DRIVER if name == SYSTEMD else CGROUPFS_DRIVER
