"""The host's routes from the kernel's text tables: parsed, and read from a namespace."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.host.routes import Route, host_routes

# As Linux prints them (x86: the IPv4 words in little-endian hex).
IPV4_TABLE = """\
Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
cni0\t0000580A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
down0\t0000590A\t00000000\t0000\t0\t0\t0\t0000FFFF\t0\t0\t0
"""
IPV6_TABLE = """\
fd000000000000000000000000000000 40 00000000000000000000000000000000 00 \
00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
fe800000000000000000000000000000 40 00000000000000000000000000000000 00 \
00000000000000000000000000000000 00000100 00000001 00000000 00000001 veth1234
ff000000000000000000000000000000 08 00000000000000000000000000000000 00 \
00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
"""


@pytest.mark.skipif(sys.byteorder != "little", reason="the sample is an x86 table")
def test_tables_are_parsed_into_networks_and_interfaces(tmp_path: Path) -> None:
    (tmp_path / "route").write_text(IPV4_TABLE)
    (tmp_path / "ipv6_route").write_text(IPV6_TABLE)
    assert host_routes(proc_net=tmp_path) == [
        Route(ipaddress.ip_network("0.0.0.0/0"), "eth0"),
        Route(ipaddress.ip_network("10.88.0.0/16"), "cni0"),
        Route(ipaddress.ip_network("192.0.2.0/24"), "eth0"),
        # down0's route is not up; link-local, multicast and lo's rejecting route are out.
        Route(ipaddress.ip_network("fd00::/64"), "eth0"),
    ]
    assert [r.network.version for r in host_routes({4}, tmp_path)] == [4, 4, 4]
    assert host_routes({6}, tmp_path) == [Route(ipaddress.ip_network("fd00::/64"), "eth0")]


def test_a_missing_table_contributes_nothing(tmp_path: Path) -> None:
    (tmp_path / "route").write_text(IPV4_TABLE.splitlines()[0] + "\n")
    assert host_routes(proc_net=tmp_path) == []


@pytest.fixture
def namespace() -> Iterator[int]:
    """A process in a network namespace of the test's own; its PID."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    proc = subprocess.Popen(["unshare", "--net", "sleep", "300"])
    try:
        net = Path(f"/proc/{proc.pid}/ns/net")
        while net.exists() and os.readlink(net) == os.readlink("/proc/self/ns/net"):
            time.sleep(0.01)  # until unshare has made the namespace
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.root
def test_routes_are_read_from_the_kernel(namespace: int) -> None:
    def ip(*args: str) -> None:
        subprocess.run(["nsenter", "-t", str(namespace), "-n", "ip", *args], check=True)

    # A bridge with no port has no carrier; its routes are there all the same, as those
    # of a cni0 that holds no pod.
    ip("link", "add", "taken0", "type", "bridge")
    ip("addr", "add", "10.88.0.1/16", "dev", "taken0")
    ip("link", "set", "taken0", "up")
    ip("route", "add", "10.89.4.0/24", "dev", "taken0")
    ip("-6", "addr", "add", "fd12:3456::1/64", "dev", "taken0", "nodad")
    routes = host_routes(proc_net=Path(f"/proc/{namespace}/net"))
    assert Route(ipaddress.ip_network("10.88.0.0/16"), "taken0") in routes
    assert Route(ipaddress.ip_network("10.89.4.0/24"), "taken0") in routes
    assert Route(ipaddress.ip_network("fd12:3456::/64"), "taken0") in routes
    # Only that namespace's: the host's interfaces are not there.
    assert {r.interface for r in routes} == {"taken0"}
