"""Host inspection for the network integration tests: mounts, the test bridge, waiting."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cri_shim.host import mounts
from cri_shim.network.cni import CniNetwork
from tests.harness import bridge_veths, host_local_allocations

REPO = Path(__file__).resolve().parents[3]


def mounts_below(path: Path) -> list[str]:
    """Mount points at or under `path`, from /proc/self/mountinfo."""
    prefix = str(path)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def mount_options(path: Path) -> str:
    """The optional fields (propagation) of the mount at exactly `path`."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                return " ".join(fields[6 : fields.index("-")])
    raise AssertionError(f"{path} is not a mount point")


async def wait_until(condition: Callable[[], bool], limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def detach_mounts_below(path: Path) -> None:
    for point in sorted(mounts_below(path), key=len, reverse=True):
        mounts.detach(Path(point))


def nat_chains() -> set[str]:
    out = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True)
    return {line.split()[1] for line in out.stdout.splitlines() if line.startswith("-N ")}


def nat_rules_mentioning(text: str) -> list[str]:
    out = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if text in line]


def remove_new_empty_nat_chains(before: set[str]) -> None:
    """Drop the shared CNI-HOSTPORT-* chains portmap created, once no pod uses them.

    portmap's DEL removes a pod's own chain (CNI-DN-...) but keeps its shared chains and
    the jumps to them. They stay if they existed before the test or if any pod chain is
    left (another test's pod).
    """
    chains = nat_chains()
    if any(chain.startswith("CNI-DN-") for chain in chains):
        return
    new = sorted(c for c in chains - before if c.startswith("CNI-HOSTPORT-"))
    for chain in new:
        for rule in nat_rules_mentioning(f"-j {chain}"):
            delete = shlex.split(rule.replace("-A ", "-D ", 1))
            subprocess.run(["iptables", "-t", "nat", *delete], capture_output=True)
    for chain in new:
        subprocess.run(["iptables", "-t", "nat", "-F", chain], capture_output=True)
        subprocess.run(["iptables", "-t", "nat", "-X", chain], capture_output=True)


@dataclass
class BridgeNetwork:
    """A conflist on a test bridge: bridge + host-local in tmp, then slow-cni."""

    network: CniNetwork
    bridge: str
    subnet: str
    ipam_dir: Path
    delay_file: Path
    fail_file: Path
    count_file: Path

    def allocations(self) -> list[str]:
        return host_local_allocations(self.ipam_dir, "crishim-nettest")

    def veths(self) -> list[str]:
        return bridge_veths(self.bridge)

    def calls(self) -> list[str]:
        if not self.count_file.exists():
            return []
        return self.count_file.read_text().splitlines()
