"""Fixtures of the network integration tests: a pinner in tmp and a bridge of our own.

Everything these fixtures add to the host (pin mounts, the test bridge, host-local
allocations) is removed at teardown, whatever the test did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from network_host import (
    REPO,
    BridgeNetwork,
    detach_mounts_below,
    nat_chains,
    remove_new_empty_nat_chains,
)

from cri_shim.network.cni import CniNetwork
from cri_shim.network.netns import NamespacePinner

SLOW_CNI_DIR = REPO / "tests" / "fixtures" / "cni"
SYSTEM_CNI_DIR = Path("/usr/lib/cni")


@pytest.fixture
async def pinner(tmp_path: Path) -> AsyncIterator[NamespacePinner]:
    run_root = tmp_path / "run"
    made = NamespacePinner(run_root)
    yield made
    for pin in made.pinned():
        await made.unpin(pin)
    made.close()
    # The pin directories themselves are mount points (made shared on first use).
    detach_mounts_below(run_root)


def _bridge_network(tmp_path: Path, *, portmap: bool) -> Iterator[BridgeNetwork]:
    if not (SYSTEM_CNI_DIR / "bridge").exists():
        pytest.skip("containernetworking-plugins are not installed")
    # A name and subnet of this test run's own, unlikely to clash with anything real.
    bridge = f"crishimt{os.getpid() % 10000}"
    subnet = f"10.244.{200 + os.getpid() % 50}.0/24"
    base = tmp_path / "cni"
    config_dir, ipam_dir, control = base / "net.d", base / "ipam", base / "control"
    for directory in (config_dir, ipam_dir, control):
        directory.mkdir(parents=True)
    plugins: list[dict[str, Any]] = [
        {
            "type": "bridge",
            "bridge": bridge,
            "isGateway": True,
            # No masquerading: it would leave iptables rules behind on the host.
            "ipMasq": False,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "dataDir": str(ipam_dir),
            },
        },
        {
            "type": "slow-cni",
            "delayFile": str(control / "delay"),
            "failFile": str(control / "fail"),
            "countFile": str(control / "count"),
        },
    ]
    if portmap:
        plugins.insert(1, {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True})
    conflist = {"cniVersion": "1.0.0", "name": "crishim-nettest", "plugins": plugins}
    (config_dir / "10-nettest.conflist").write_text(json.dumps(conflist))
    forward = Path("/proc/sys/net/ipv4/ip_forward")
    forward_before = forward.read_text()
    nat_chains_before = nat_chains()

    yield BridgeNetwork(
        network=CniNetwork(config_dir, [SLOW_CNI_DIR, SYSTEM_CNI_DIR], None),
        bridge=bridge,
        subnet=subnet,
        ipam_dir=ipam_dir,
        delay_file=control / "delay",
        fail_file=control / "fail",
        count_file=control / "count",
    )
    subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
    # The bridge plugin turns on forwarding for a gateway; give the host back its setting.
    forward.write_text(forward_before)
    if portmap:
        remove_new_empty_nat_chains(nat_chains_before)


@pytest.fixture
def bridge_network(tmp_path: Path) -> Iterator[BridgeNetwork]:
    """bridge (host-local IPAM in tmp) then slow-cni."""
    yield from _bridge_network(tmp_path, portmap=False)


@pytest.fixture
def portmap_network(tmp_path: Path) -> Iterator[BridgeNetwork]:
    """bridge, portmap with snat (as the bundled network has it), then slow-cni."""
    if not (SYSTEM_CNI_DIR / "portmap").exists() or shutil.which("iptables") is None:
        pytest.skip("portmap plugin or iptables missing")
    yield from _bridge_network(tmp_path, portmap=True)
