"""CNI on the real host: a pinned netns attached to a test bridge, then fully detached."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from network_host import BridgeNetwork, mounts_below, nat_rules_mentioning, wait_until

from cri_shim.errors import DeadlineExceeded, Internal
from cri_shim.network.cni import PodNetworkRequest
from cri_shim.network.netns import NamespacePinner, PinnedNamespaces

pytestmark = [pytest.mark.integration, pytest.mark.root]

ADD_BUDGET = 60.0


def ping(ip: str) -> bool:
    command = ["ping"] if shutil.which("ping") else ["busybox", "ping"]
    done = subprocess.run([*command, "-c1", "-W1", ip], capture_output=True, check=False)
    return done.returncode == 0


def hostname_in(uts: Path | None) -> str:
    done = subprocess.run(
        ["nsenter", f"--uts={uts}", "hostname"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def plugin_processes(pod_id: str) -> list[int]:
    """Processes whose environment names this pod as CNI_CONTAINERID."""
    marker = f"CNI_CONTAINERID={pod_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def attach_target(pinner: NamespacePinner, pod_id: str) -> PinnedNamespaces:
    return await pinner.pin(pod_id, net=True, uts=True, ipc=True, hostname=f"host-{pod_id}")


def request(pod_id: str, pins: PinnedNamespaces) -> PodNetworkRequest:
    assert pins.net is not None
    return PodNetworkRequest(pod_id, pins.net, f"pod-{pod_id}", "nettest", f"uid-{pod_id}", [])


def assert_nothing_left(net: BridgeNetwork, pinner: NamespacePinner, pod_id: str) -> None:
    assert net.veths() == []
    assert net.allocations() == []
    assert [p for p in pinner.pinned() if p.name == pod_id] == []
    assert [m for m in mounts_below(pinner.run_root) if m.endswith("/" + pod_id)] == []


async def test_attached_pod_is_reachable_and_detaches_without_trace(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    pins = await attach_target(pinner, "pod1")
    req = request("pod1", pins)
    result = await bridge_network.network.add(req, ADD_BUDGET)

    (ip,) = result.ips
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(bridge_network.subnet)
    assert await asyncio.to_thread(ping, ip)
    assert bridge_network.allocations() == [ip]
    assert len(bridge_network.veths()) == 1
    assert hostname_in(pins.uts) == "host-pod1"

    # Network before namespace: the plugins need the netns to find the veth.
    await bridge_network.network.delete(req, 30, prev_result=result.raw, config=result.config)
    for path in pins.paths():
        await pinner.unpin(path)
    assert_nothing_left(bridge_network, pinner, "pod1")
    assert not await asyncio.to_thread(ping, ip)
    assert bridge_network.calls() == ["ADD pod1", "DEL pod1"]


async def test_del_is_idempotent_and_works_after_the_netns_is_gone(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    pins = await attach_target(pinner, "pod1")
    req = request("pod1", pins)
    result = await bridge_network.network.add(req, ADD_BUDGET)
    # Wrong order on purpose, as after a crash: the netns is gone before the DEL.
    for path in pins.paths():
        await pinner.unpin(path)
    await bridge_network.network.delete(req, 30, prev_result=result.raw)
    await bridge_network.network.delete(req, 30, prev_result=result.raw)
    await bridge_network.network.delete(req, 30)
    # The veth dies with its netns, asynchronously in the kernel.
    await wait_until(lambda: bridge_network.veths() == [])
    assert_nothing_left(bridge_network, pinner, "pod1")


async def test_pods_get_distinct_ips(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    pods = [f"pod{i}" for i in range(5)]
    all_pins = [await attach_target(pinner, p) for p in pods]
    reqs = [request(p, pins) for p, pins in zip(pods, all_pins, strict=True)]
    results = await asyncio.gather(*(bridge_network.network.add(r, ADD_BUDGET) for r in reqs))
    ips = [r.ips[0] for r in results]
    assert len(set(ips)) == 5
    assert sorted(bridge_network.allocations()) == sorted(ips)
    await asyncio.gather(*(bridge_network.network.delete(r, 30) for r in reqs))
    for pins in all_pins:
        for path in pins.paths():
            await pinner.unpin(path)
    for pod in pods:
        assert_nothing_left(bridge_network, pinner, pod)


async def test_chained_slow_plugin_delays_and_is_counted(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    bridge_network.delay_file.write_text("1.0")
    pins = await attach_target(pinner, "pod1")
    req = request("pod1", pins)
    started = time.monotonic()
    result = await bridge_network.network.add(req, ADD_BUDGET)
    assert time.monotonic() - started >= 1.0
    assert result.ips
    assert bridge_network.calls() == ["ADD pod1"]
    await bridge_network.network.delete(req, 30, prev_result=result.raw)
    assert bridge_network.calls() == ["ADD pod1", "DEL pod1"]


async def test_failing_plugin_surfaces_its_message_and_leaves_nothing(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    bridge_network.fail_file.write_text("quota of pods on this node reached")
    pins = await attach_target(pinner, "pod1")
    with pytest.raises(Internal) as failure:
        await bridge_network.network.add(request("pod1", pins), ADD_BUDGET)
    message = str(failure.value)
    assert "CNI plugin slow-cni (network crishim-nettest) ADD" in message
    assert "quota of pods on this node reached" in message
    # The bridge plugin had allocated an IP and a veth; the cleanup DEL gave them back.
    assert bridge_network.allocations() == []
    assert bridge_network.veths() == []
    assert bridge_network.calls() == ["ADD pod1", "DEL pod1"]
    for path in pins.paths():
        await pinner.unpin(path)
    assert_nothing_left(bridge_network, pinner, "pod1")


async def test_timeout_kills_the_plugin_and_undoes_the_add(
    pinner: NamespacePinner, bridge_network: BridgeNetwork
) -> None:
    bridge_network.delay_file.write_text("60")
    pins = await attach_target(pinner, "pod1")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="slow-cni"):
        await bridge_network.network.add(request("pod1", pins), 2.0)
    assert time.monotonic() - started < 10
    assert plugin_processes("pod1") == []
    assert bridge_network.calls() == ["ADD pod1", "DEL pod1"]
    assert bridge_network.allocations() == []
    assert bridge_network.veths() == []
    for path in pins.paths():
        await pinner.unpin(path)
    assert_nothing_left(bridge_network, pinner, "pod1")


def test_bridge_fixture_uses_its_own_names(bridge_network: BridgeNetwork) -> None:
    # Guard for the cleanup above: never touch a bridge or subnet a real node uses.
    assert bridge_network.bridge.startswith("crishimt")
    assert len(bridge_network.bridge) <= 15
    assert bridge_network.subnet.startswith("10.244.2")
    assert str(bridge_network.ipam_dir).startswith(str(Path(os.environ.get("TMPDIR", "/tmp"))))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("0.0.0.0", 0))
        return int(probe.getsockname()[1])


def serve_once_in(netns: Path, port: int) -> subprocess.Popen[bytes]:
    """A one-shot TCP server inside the pod's netns that answers with a greeting."""
    server = (
        "import socket,sys\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {port})); s.listen(); print('ready', flush=True)\n"
        "while True:\n"
        "    c,_=s.accept(); c.sendall(b'hello from the pod'); c.close()\n"
    )
    proc = subprocess.Popen(
        ["nsenter", f"--net={netns}", sys.executable, "-c", server], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def fetch(host: str, port: int) -> bytes:
    with socket.create_connection((host, port), timeout=3) as conn:
        return conn.recv(100)


async def test_host_port_reaches_the_pod_from_loopback(
    pinner: NamespacePinner, portmap_network: BridgeNetwork
) -> None:
    pod_id = f"pm{os.getpid()}"
    pins = await attach_target(pinner, pod_id)
    host_port = free_port()
    req = request(pod_id, pins)
    req.port_mappings = [{"hostPort": host_port, "containerPort": 8080, "protocol": "TCP"}]
    result = await portmap_network.network.add(req, ADD_BUDGET)
    server = serve_once_in(pins.net, 8080)  # type: ignore[arg-type]
    try:
        assert await asyncio.to_thread(fetch, result.ips[0], 8080) == b"hello from the pod"
        # snat makes 127.0.0.1:hostPort work, which CRI-O's own host-port code cannot do.
        assert await asyncio.to_thread(fetch, "127.0.0.1", host_port) == b"hello from the pod"
        assert nat_rules_mentioning(pod_id) != []
    finally:
        server.kill()
        server.wait()
    await portmap_network.network.delete(req, 30, prev_result=result.raw, config=result.config)
    assert nat_rules_mentioning(pod_id) == []
    for path in pins.paths():
        await pinner.unpin(path)
    assert_nothing_left(portmap_network, pinner, pod_id)
