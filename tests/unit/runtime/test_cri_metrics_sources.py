"""The readers behind ListPodSandboxMetrics, on fake cgroup trees and /proc/net/dev text."""

from __future__ import annotations

from pathlib import Path

from cri_shim.network.netdev import parse_net_dev
from cri_shim.runtime.cgroup_layout import cgroup_layout
from cri_shim.server.metrics_messages import metric_descriptors

# Real /proc/net/dev lines, with the runs of spaces squeezed (the parser splits on any).
NET_DEV = (
    "Inter-| Receive | Transmit\n"
    " face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop "
    "fifo colls carrier compressed\n"
    "    lo: 100 2 0 0 0 0 0 0 100 2 0 0 0 0 0 0\n"
    "  eth0: 5000 40 1 2 0 0 0 0 3000 30 3 4 0 0 0 0\n"
)


def test_net_dev_is_parsed_per_interface() -> None:
    counters = parse_net_dev(NET_DEV)
    assert set(counters) == {"lo", "eth0"}
    eth0 = counters["eth0"]
    assert (eth0.rx_bytes, eth0.rx_packets, eth0.rx_errors, eth0.rx_dropped) == (5000, 40, 1, 2)
    assert (eth0.tx_bytes, eth0.tx_packets, eth0.tx_errors, eth0.tx_dropped) == (3000, 30, 3, 4)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_figures(tmp_path: Path) -> None:
    group = "/kubepods/pod1/cri-shim-abc"
    _write(tmp_path / "cpuacct" / group[1:] / "cpuacct.usage", "3000000000\n")
    _write(tmp_path / "cpuacct" / group[1:] / "cpuacct.usage_user", "2000000000\n")
    _write(tmp_path / "cpuacct" / group[1:] / "cpuacct.usage_sys", "1000000000\n")
    memory = tmp_path / "memory" / group[1:]
    _write(memory / "memory.usage_in_bytes", "1000\n")
    _write(memory / "memory.max_usage_in_bytes", "2000\n")
    _write(memory / "memory.limit_in_bytes", str(9223372036854771712) + "\n")  # unlimited
    _write(memory / "memory.stat", "total_cache 300\ntotal_rss 600\ntotal_inactive_file 100\n")
    _write(memory / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    _write(tmp_path / "pids" / group[1:] / "cgroup.procs", "10\n11\n")
    _write(tmp_path / "pids" / group[1:] / "tasks", "10\n11\n12\n")
    figures = cgroup_layout(tmp_path, v2=False).figures(group)
    assert (figures.cpu_usage_ns, figures.cpu_user_ns, figures.cpu_system_ns) == (
        3_000_000_000,
        2_000_000_000,
        1_000_000_000,
    )
    assert (figures.memory_usage_bytes, figures.memory_working_set_bytes) == (1000, 900)
    assert (figures.memory_cache_bytes, figures.memory_rss_bytes) == (300, 600)
    assert (figures.memory_max_usage_bytes, figures.memory_limit_bytes) == (2000, None)
    assert (figures.oom_kills, figures.processes, figures.threads) == (1, 2, 3)


def test_cgroup_v2_figures_and_missing_files(tmp_path: Path) -> None:
    group = tmp_path / "kubepods" / "c1"
    _write(group / "cpu.stat", "usage_usec 3000\nuser_usec 2000\nsystem_usec 1000\n")
    _write(group / "memory.current", "5000\n")
    _write(group / "memory.max", "max\n")
    _write(group / "memory.stat", "anon 4000\nfile 700\ninactive_file 200\n")
    _write(group / "cgroup.procs", "1\n")
    figures = cgroup_layout(tmp_path, v2=True).figures("/kubepods/c1")
    assert (figures.cpu_usage_ns, figures.cpu_user_ns, figures.cpu_system_ns) == (
        3_000_000,
        2_000_000,
        1_000_000,
    )
    assert (figures.memory_working_set_bytes, figures.memory_cache_bytes) == (4800, 700)
    assert figures.memory_limit_bytes is None and figures.memory_max_usage_bytes is None
    assert figures.processes == 1 and figures.threads is None  # no cgroup.threads: unknown
    gone = cgroup_layout(tmp_path, v2=True).figures("/kubepods/gone")
    assert gone.cpu_usage_ns is None and gone.processes is None


def test_every_descriptor_is_unique_and_documented() -> None:
    descriptors = metric_descriptors()
    names = [d.name for d in descriptors]
    assert len(names) == len(set(names))
    assert all(d.help and d.label_keys for d in descriptors)
