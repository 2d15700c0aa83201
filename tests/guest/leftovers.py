"""What the daemon must not leave on a node once its pods are gone: systemd units (the
containers' and conmons' scopes, `cri-shim-*`), cgroups named after it, and mounts under
its roots or work directories. The guest lane's last step (tests/guest/lane.sh) runs it
after the others, which stopped their daemons and removed their pods.

    python -m tests.guest.leftovers     prints what is left; exits 1 if anything is

What a daemon keeps for all its objects is not left by any of them, and stays: its own
unit (cri-shim.service, and its socket) while it is stopped; the cgroupfs driver's default
parent cgroup `/cri-shim` while it is empty (as system.slice stays for the systemd
driver); and each namespace pin directory (`<run root>/netns`, …), which the daemon makes
a mount point of its own, as `ip netns` does /run/netns. What is in them counts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from cri_shim.host.mounts import unescape_mountinfo

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "cri-shim"
# The daemon's state and run roots as installed, and the tests' work directories
# (tests/conformance.py's cs-conf-*, the harness's and guest tests' cs-*).
MOUNT_ROOTS = ("/var/lib/cri-shim", "/run/cri-shim", "/tmp/cs-")
DAEMON_UNITS = ("cri-shim.service", "cri-shim.socket")
DEFAULT_PARENT = "/cri-shim"
PIN_DIRECTORIES = ("netns", "utsns", "ipcns", "userns")  # network/netns.py


def leftover_units(list_units: str) -> list[str]:
    """Units from `systemctl list-units --all --plain --no-legend` lines (name, load,
    active, sub, description): every `cri-shim*` unit, in whatever state (a failed scope
    stays listed), but the daemon's own while they are inactive."""
    found = []
    for line in list_units.splitlines():
        fields = line.split()
        if len(fields) < 4 or not fields[0].startswith(PREFIX):
            continue
        name, active = fields[0], fields[2]
        if name in DAEMON_UNITS and active == "inactive":
            continue
        found.append(f"{name} ({active})")
    return found


def leftover_cgroups(directories: Iterable[str]) -> list[str]:
    """Cgroups (paths below the hierarchy's root) with a component of the daemon's:
    `/cri-shim/<id>` (cgroupfs, no parent given), `cri-shim-<id>` (cgroupfs),
    `cri-shim-*.scope` (systemd), `cri-shim.service` (the daemon's own, there while it
    runs); not the default parent itself."""
    return sorted(
        path
        for path in directories
        if path != DEFAULT_PARENT and any(part.startswith(PREFIX) for part in path.split("/"))
    )


def leftover_mounts(mountinfo: str) -> list[str]:
    """Mount points of /proc/self/mountinfo under the daemon's roots or work directories,
    or naming it, but its namespace pin directories themselves."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        point = unescape_mountinfo(fields[4])
        if point.rsplit("/", 1)[-1] in PIN_DIRECTORIES:
            continue
        if point.startswith(MOUNT_ROOTS) or PREFIX in point:
            found.append(point)
    return found


def cgroup_directories(root: Path = CGROUP_ROOT) -> list[str]:
    return [
        "/" + os.path.relpath(os.path.join(directory, name), root)
        for directory, subdirs, _ in os.walk(root)
        for name in subdirs
    ]


def main() -> int:
    units = subprocess.run(
        ["systemctl", "list-units", "--all", "--plain", "--no-legend", f"{PREFIX}*"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    found = {
        "units": leftover_units(units),
        "cgroups": leftover_cgroups(cgroup_directories()),
        "mounts": leftover_mounts(Path("/proc/self/mountinfo").read_text(errors="surrogateescape")),
    }
    for kind, items in found.items():
        for item in items:
            print(f"leftovers: {kind[:-1]} {item}")
    if any(found.values()):
        print("leftovers: FAILED: the node holds what the daemon left")
        return 1
    print("leftovers: none (no cri-shim unit, scope, cgroup or mount)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
