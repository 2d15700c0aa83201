"""The guest lane's leftovers check (tests/guest/leftovers.py) on fake inputs: systemctl's
unit list, cgroup paths and mountinfo lines as a node shows them."""

from __future__ import annotations

from pathlib import Path

from tests.guest.leftovers import (
    cgroup_directories,
    leftover_cgroups,
    leftover_mounts,
    leftover_units,
)

UNITS = """\
cri-shim-0123abcd.scope          loaded active   running libcontainer container 0123abcd
cri-shim-conmon-0123abcd.scope   loaded failed   failed  conmon of 0123abcd
cri-shim.service                 loaded inactive dead    cri-shim CRI runtime
cri-shim.socket                  loaded inactive dead    cri-shim CRI socket
systemd-journald.service         loaded active   running Journal Service
"""


def test_scopes_are_left_in_any_state_the_daemons_own_units_only_while_they_run() -> None:
    assert leftover_units(UNITS) == [
        "cri-shim-0123abcd.scope (active)",
        "cri-shim-conmon-0123abcd.scope (failed)",
    ]
    running = "cri-shim.service loaded active running cri-shim CRI runtime\n"
    assert leftover_units(running) == ["cri-shim.service (active)"]
    assert leftover_units("") == []


def test_cgroups_named_after_the_daemon_are_left() -> None:
    paths = [
        "/system.slice",
        "/system.slice/cri-shim-0123abcd.scope",
        "/kubepods/besteffort/pod1/cri-shim-4567",
        "/cri-shim",  # the cgroupfs driver's default parent: stays, as a slice does
        "/cri-shim/89ab",
        "/system.slice/ssh.service",
        "/user.slice/not-cri-shim-related",
    ]
    assert leftover_cgroups(paths) == [
        "/cri-shim/89ab",
        "/kubepods/besteffort/pod1/cri-shim-4567",
        "/system.slice/cri-shim-0123abcd.scope",
    ]


def test_mounts_under_the_daemons_roots_and_work_directories_are_left() -> None:
    """Not the pin directory, a mount point of the daemon's own; a pin in it is left."""
    mountinfo = "\n".join(
        [
            "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw",
            "89 22 0:26 /cri-shim/netns /run/cri-shim/netns rw shared:39 - tmpfs tmpfs rw",
            "90 89 0:4 net:[4026532] /run/cri-shim/netns/pod1 rw shared:40 - nsfs nsfs rw",
            "91 22 0:46 / /var/lib/cri-shim/containers/c1/rootfs rw - overlay overlay rw",
            "92 22 0:47 / /tmp/cs-conf-x1/root/shm rw - tmpfs shm rw",
            "93 22 0:48 / /srv/with\\040cri-shim rw - tmpfs tmpfs rw",
            "94 22 0:49 / /tmp/other rw - tmpfs tmpfs rw",
        ]
    )
    assert leftover_mounts(mountinfo) == [
        "/run/cri-shim/netns/pod1",
        "/var/lib/cri-shim/containers/c1/rootfs",
        "/tmp/cs-conf-x1/root/shm",
        "/srv/with cri-shim",
    ]


def test_cgroup_directories_are_named_below_the_root(tmp_path: Path) -> None:
    (tmp_path / "system.slice" / "cri-shim-1.scope").mkdir(parents=True)
    assert sorted(cgroup_directories(tmp_path)) == [
        "/system.slice",
        "/system.slice/cri-shim-1.scope",
    ]
