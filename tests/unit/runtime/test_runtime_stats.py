"""Container stats from cgroup v1 and v2 files, writable-layer usage, resource mapping."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.runtime.cgroup_layout import cgroup_layout
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.resources import linux_resources
from cri_shim.runtime.stats import writable_layer_usage


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("cpuacct_mount", ["cpuacct", "cpu,cpuacct"])
def test_cgroup_v1(tmp_path: Path, cpuacct_mount: str) -> None:
    group = "kubepods/pod1/cri-shim-c1"
    write(tmp_path / cpuacct_mount / group / "cpuacct.usage", "123456789\n")
    write(tmp_path / "memory" / group / "memory.usage_in_bytes", "10000000\n")
    write(
        tmp_path / "memory" / group / "memory.stat",
        "cache 5\nrss 7\ninactive_file 999\ntotal_rss 3000000\ntotal_inactive_file 4000000\n"
        "total_pgfault 77\ntotal_pgmajfault 2\n",
    )
    stats = cgroup_layout(tmp_path, v2=False).stats(f"/{group}")
    assert stats.cpu_usage_ns == 123456789
    assert stats.memory_usage_bytes == 10_000_000
    assert stats.memory_working_set_bytes == 6_000_000  # usage - total_inactive_file
    assert stats.memory_rss_bytes == 3_000_000
    assert (stats.page_faults, stats.major_page_faults) == (77, 2)
    assert stats.timestamp_ns > 0


def test_cgroup_v2(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "cpu memory\n")
    group = tmp_path / "cri-shim" / "c1"
    write(group / "cpu.stat", "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
    write(group / "memory.current", "8000\n")
    write(
        group / "memory.stat", "anon 3000\nfile 5000\ninactive_file 9000\npgfault 5\npgmajfault 1\n"
    )
    stats = cgroup_layout(tmp_path).stats("/cri-shim/c1")  # v2 detected from the root
    assert stats.cpu_usage_ns == 1_500_000
    assert stats.memory_usage_bytes == 8000
    assert stats.memory_working_set_bytes == 0  # never negative
    assert stats.memory_rss_bytes == 3000
    assert (stats.page_faults, stats.major_page_faults) == (5, 1)


def test_missing_cgroup_gives_none(tmp_path: Path) -> None:
    stats = cgroup_layout(tmp_path, v2=False).stats("/gone")
    assert stats.cpu_usage_ns is None and stats.memory_working_set_bytes is None


def test_oom_kill_count(tmp_path: Path) -> None:
    write(
        tmp_path / "memory" / "g" / "memory.oom_control",
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
    )
    write(tmp_path / "g" / "memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert cgroup_layout(tmp_path, v2=False).oom_kills("/g") == 2
    assert cgroup_layout(tmp_path, v2=True).oom_kills("/g") == 1
    assert cgroup_layout(tmp_path, v2=False).oom_kills("/none") == 0


def test_writable_layer_usage_counts_blocks_and_hard_links_once(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "dir" / "sub").mkdir(parents=True)
    (upper / "dir" / "sub" / "big").write_bytes(b"x" * 100_000)
    os.link(upper / "dir" / "sub" / "big", upper / "dir" / "hardlink")
    (upper / "dir" / "link").symlink_to("/etc/passwd")  # not followed
    usage = writable_layer_usage(upper)
    big = (upper / "dir" / "sub" / "big").stat().st_blocks * 512
    assert usage.inodes_used == 4  # dir, sub, big (+hard link), link
    assert big <= usage.used_bytes < big + 4 * 8192
    assert writable_layer_usage(tmp_path / "missing").used_bytes == 0


def test_update_mapping_leaves_unset_fields_out(tmp_path: Path) -> None:
    host = HostLimits(frozenset(), 0, 1024, cgroup_v2=False, swap_accounting=False)
    assert linux_resources(api_pb2.LinuxContainerResources(), host) == {}
    assert linux_resources(api_pb2.LinuxContainerResources(cpu_quota=-1), host) == {
        "cpu": {"quota": -1}
    }
    with pytest.raises(InvalidArgument, match="cpu_quota"):
        linux_resources(api_pb2.LinuxContainerResources(cpu_quota=-2), host)
    swap = api_pb2.LinuxContainerResources(memory_swap_limit_in_bytes=1 << 30)
    assert linux_resources(swap, host) == {}  # no swap accounting: not sent to runc
