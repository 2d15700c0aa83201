"""The daemon refuses a network whose subnet the host routes through another interface.

A bridge of the test's own takes the test network's subnet, as `cni0` holds containerd's
and podman's default 10.88.0.0/16 on a host that runs them: the daemon's Status says the
network is not ready and names that bridge, and no pod is attached to it (its pods could
not be reached from the host). With the bridge gone, the network is ready again.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, pod_config
from tests.integration.cri_testkit import remove_pod, run_pod

pytestmark = [pytest.mark.integration, pytest.mark.root]


def network_condition(daemon: Daemon) -> api_pb2.RuntimeCondition:
    status = daemon.runtime().Status(api_pb2.StatusRequest(), timeout=10)
    (condition,) = [c for c in status.status.conditions if c.type == "NetworkReady"]
    return condition


def warnings(daemon: Daemon, other: str) -> int:
    """The daemon's warnings that the network is not ready because of `other`."""
    return sum(
        1
        for line in daemon.log_path.read_text().splitlines()
        if "level=warning" in line and "CNI network not ready" in line and other in line
    )


@pytest.fixture
def other_bridge(daemon: Daemon) -> Iterator[str]:
    """A bridge holding an address of the test network's subnet, and so its route."""
    assert daemon.network is not None
    name = f"crisu{os.getpid() % 100000}"
    subnet = ipaddress.ip_network(daemon.network.subnet)
    address = f"{subnet.broadcast_address - 1}/{subnet.prefixlen}"
    subprocess.run(["ip", "link", "add", name, "type", "bridge"], check=True)
    try:
        subprocess.run(["ip", "addr", "add", address, "dev", name], check=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)


def test_a_subnet_routed_through_another_interface_is_refused(
    daemon: Daemon, other_bridge: str
) -> None:
    assert daemon.network is not None
    # Said at start, before any client asks.
    daemon.restart()
    assert warnings(daemon, other_bridge) == 1

    condition = network_condition(daemon)
    assert (condition.status, condition.reason) == (False, "NetworkSubnetInUse")
    assert f"its subnet {daemon.network.subnet} is already routed through {other_bridge}" in (
        condition.message
    )
    assert f"not through the network's bridge {daemon.network.bridge}" in condition.message

    with pytest.raises(grpc.RpcError) as refused:
        run_pod(daemon, pod_config("web", uid="uid-web"))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"routed through {other_bridge}" in str(refused.value.details())
    assert daemon.network.adds() == 0
    assert warnings(daemon, other_bridge) == 1  # only once

    subprocess.run(["ip", "link", "del", other_bridge], check=True)
    assert network_condition(daemon).status is True
    sandbox_id = run_pod(daemon, pod_config("web", uid="uid-web"))
    remove_pod(daemon, sandbox_id)
    assert daemon.leaks() == {}
