"""A bridge network whose subnet the host already routes through another interface is
not ready: its pods could not be reached from the host (kubelet's probes included)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest
from fake_cni import FakeCni

from cri_shim.errors import Unavailable
from cri_shim.host.routes import Route
from cri_shim.network.cni import SUBNET_IN_USE_REASON, CniNetwork, PodNetworkRequest


def route(network: str, interface: str) -> Route:
    return Route(ipaddress.ip_network(network), interface)


def bridge(subnet: str = "10.88.0.0/16", name: str | None = "cri-shim0") -> dict[str, Any]:
    plugin: dict[str, Any] = {
        "type": "bridge",
        "isGateway": True,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]]},
    }
    if name is not None:
        plugin["bridge"] = name
    return plugin


class Routes:
    """The host's routing table, as the test sets it."""

    def __init__(self, *routes: Route) -> None:
        self.table = list(routes)

    def __call__(self, versions: Collection[int]) -> list[Route]:
        return [r for r in self.table if r.network.version in versions]


HOST = (route("0.0.0.0/0", "eth0"), route("192.0.2.0/24", "eth0"))


def network(fake: FakeCni, routes: Routes) -> CniNetwork:
    return CniNetwork(fake.config_dir, [fake.bin_dir], None, routes=routes)


def test_a_subnet_routed_through_another_interface_is_not_ready(fake_cni: FakeCni) -> None:
    source = fake_cni.write_conflist([bridge(), {"type": "portmap"}], name="cri-shim")
    routes = Routes(*HOST, route("10.88.0.0/16", "cni0"), route("10.88.0.0/16", "cri-shim0"))
    ready, reason, message = network(fake_cni, routes).status()
    assert (ready, reason) == (False, SUBNET_IN_USE_REASON)
    assert message.startswith(f"CNI network 'cri-shim' ({source}): its subnet 10.88.0.0/16")
    assert "routed through cni0 (10.88.0.0/16)" in message
    assert "not through the network's bridge cri-shim0" in message


@pytest.mark.parametrize(
    ("taken", "conflict"),
    [
        ("10.88.0.0/16", True),  # the same subnet: containerd's or podman's default network
        ("10.88.7.0/24", True),  # a part of it: that part's pods are out of reach
        ("10.88.0.7/32", True),
        ("10.0.0.0/8", False),  # wider: the bridge's own route is the more specific one
        ("10.89.0.0/16", False),
        ("fd00::/64", False),
    ],
)
def test_only_a_route_at_least_as_specific_conflicts(
    fake_cni: FakeCni, taken: str, conflict: bool
) -> None:
    fake_cni.write_conflist([bridge()])
    ready, _, _ = network(fake_cni, Routes(*HOST, route(taken, "eth1"))).status()
    assert ready is not conflict


def test_the_bridges_own_route_is_no_conflict(fake_cni: FakeCni) -> None:
    # The plugin's bridge is cni0 when the config names none.
    fake_cni.write_conflist([bridge(name=None)])
    assert network(fake_cni, Routes(*HOST, route("10.88.0.0/16", "cni0"))).status()[0]


def test_every_range_and_the_older_single_subnet_are_checked(fake_cni: FakeCni) -> None:
    plugin = bridge("10.88.0.0/16")
    plugin["ipam"]["ranges"].append([{"subnet": "fd88::/64"}])
    fake_cni.write_conflist([plugin])
    assert not network(fake_cni, Routes(route("fd88::/64", "podman0"))).status()[0]
    older = {
        "type": "bridge",
        "bridge": "b0",
        "ipam": {"type": "host-local", "subnet": "10.7.0.0/16"},
    }
    fake_cni.write_conflist([older])
    assert not network(fake_cni, Routes(route("10.7.0.0/16", "eth1"))).status()[0]


def test_networks_without_a_bridge_are_not_checked(fake_cni: FakeCni) -> None:
    ptp = {"type": "ptp", "ipam": {"type": "host-local", "subnet": "10.88.0.0/16"}}
    fake_cni.write_conflist([ptp])
    assert network(fake_cni, Routes(route("10.88.0.0/16", "cni0"))).status()[0]


async def test_no_pod_is_attached_while_the_subnet_is_routed_elsewhere(
    fake_cni: FakeCni,
) -> None:
    fake_cni.write_conflist([bridge()])
    routes = Routes(*HOST, route("10.88.0.0/16", "cni0"))
    net = network(fake_cni, routes)
    req = PodNetworkRequest("p1", Path("/nonexistent"), "web", "default", "uid-1", [])
    with pytest.raises(Unavailable, match=r"network is not ready: .* routed through cni0"):
        await net.add(req, timeout=5)
    assert fake_cni.calls() == []
    # The undo of that refused ADD (a DEL is journaled before every ADD) still runs.
    await net.delete(req, timeout=5)
    assert [call["command"] for call in fake_cni.calls()] == ["DEL"]
    # The other interface's route gone, the network is ready again: nothing is cached.
    routes.table = list(HOST)
    assert net.status() == (True, "", "")


def test_the_conflict_is_logged_once_and_its_end_too(
    fake_cni: FakeCni, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cni.write_conflist([bridge()])
    routes = Routes(*HOST, route("10.88.0.0/16", "cni0"))
    net = network(fake_cni, routes)
    with caplog.at_level(logging.INFO, logger="cri_shim.network.cni"):
        for _ in range(3):
            net.status()
        routes.table = list(HOST)
        net.status()
        net.status()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "routed through cni0" in warnings[0].getMessage()
    assert [r.getMessage() for r in caplog.records if "no longer routed" in r.getMessage()] == [
        "CNI network 'fake-net': its subnet is no longer routed elsewhere"
    ]
