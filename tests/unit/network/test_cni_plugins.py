"""Running CNI plugins: environment, chaining, runtimeConfig, errors, timeouts, results."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from cni_support import network_name
from fake_cni import FakeCni

from cri_shim.errors import DeadlineExceeded, Internal, InvalidArgument
from cri_shim.network.cni import CniNetwork, PodNetworkRequest, result_ips
from tests.waiting import until

POD_ID = "a" * 64

RESULT_1_0 = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "cni0", "mac": "00:11:22:33:44:55"},
        {"name": "veth1", "mac": "00:11:22:33:44:66"},
        {"name": "eth0", "mac": "00:11:22:33:44:77", "sandbox": "/run/netns/x"},
    ],
    "ips": [
        {"address": "fd00::5/64", "interface": 2},
        {"address": "10.22.0.1/24", "interface": 0},
        {"address": "10.22.0.5/24", "gateway": "10.22.0.1", "interface": 2},
    ],
}


def request(**overrides: Any) -> PodNetworkRequest:
    fields: dict[str, Any] = {
        "pod_id": POD_ID,
        "netns": Path("/run/cri-shim/netns") / POD_ID,
        "name": "web-0",
        "namespace": "shop",
        "uid": "5f0c-uid",
        "port_mappings": [],
    }
    fields.update(overrides)
    return PodNetworkRequest(**fields)


def network(fake: FakeCni, **kwargs: Any) -> CniNetwork:
    return CniNetwork(fake.config_dir, [fake.bin_dir, Path("/nonexistent/bin")], None, **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; only a running process counts.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_add_passes_the_cni_environment(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "one", "result": RESULT_1_0}])
    await network(fake_cni).add(request(), timeout=10)

    (call,) = fake_cni.calls()
    assert call["command"] == "ADD"
    assert call["env"] == {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": POD_ID,
        "CNI_NETNS": f"/run/cri-shim/netns/{POD_ID}",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": f"{fake_cni.bin_dir}:/nonexistent/bin",
        "CNI_ARGS": (
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;"
            f"K8S_POD_INFRA_CONTAINER_ID={POD_ID};K8S_POD_UID=5f0c-uid"
        ),
    }


async def test_add_chains_results_and_returns_pod_ips(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist(
        [{"type": "main", "result": RESULT_1_0, "mtu": 1400}, {"type": "chained"}], name="chain"
    )
    result = await network(fake_cni).add(request(), timeout=10)

    first, second = fake_cni.calls()
    assert [first["stdin"]["type"], second["stdin"]["type"]] == ["main", "chained"]
    assert "prevResult" not in first["stdin"]
    assert first["stdin"]["name"] == "chain" and first["stdin"]["cniVersion"] == "1.0.0"
    assert first["stdin"]["mtu"] == 1400
    assert second["stdin"]["prevResult"] == RESULT_1_0
    # IPv4 first; the gateway address on the host-side bridge is not a pod IP.
    assert result.ips == ["10.22.0.5", "fd00::5"]
    assert result.raw == RESULT_1_0
    assert result.config["name"] == "chain" and len(result.config["plugins"]) == 2


async def test_runtime_config_only_for_declared_capabilities(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist(
        [
            {"type": "main", "result": RESULT_1_0},
            {"type": "ports", "capabilities": {"portMappings": True}},
            {"type": "other", "capabilities": {"bandwidth": True, "portMappings": False}},
        ]
    )
    mappings = [
        {"hostPort": 8080, "containerPort": 80, "protocol": "TCP", "hostIP": ""},
        {"hostPort": 5353, "containerPort": 53, "protocol": "UDP", "hostIP": "127.0.0.1"},
        # No host port: only documents the container port, nothing to map.
        {"hostPort": 0, "containerPort": 9090, "protocol": "TCP"},
    ]
    await network(fake_cni).add(request(port_mappings=mappings), timeout=10)

    main, ports, other = (c["stdin"] for c in fake_cni.calls())
    assert "runtimeConfig" not in main
    assert "runtimeConfig" not in other
    assert ports["runtimeConfig"] == {
        "portMappings": [
            {"hostPort": 8080, "containerPort": 80, "protocol": "tcp"},
            {"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "127.0.0.1"},
        ]
    }


async def test_del_gets_the_same_port_mappings_and_prev_result(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "ports", "capabilities": {"portMappings": True}}])
    mappings = [{"hostPort": 8080, "containerPort": 80, "protocol": "TCP"}]
    await network(fake_cni).delete(request(port_mappings=mappings), 10, prev_result=RESULT_1_0)
    (call,) = fake_cni.calls()
    assert call["command"] == "DEL"
    assert call["stdin"]["runtimeConfig"]["portMappings"][0]["hostPort"] == 8080
    assert call["stdin"]["prevResult"] == RESULT_1_0


def test_result_ips_of_a_0_4_0_result() -> None:
    result = {
        "cniVersion": "0.4.0",
        "interfaces": [{"name": "eth0", "sandbox": "/proc/1/ns/net"}],
        "ips": [
            {"version": "6", "address": "2001:db8::2/64", "interface": 0},
            {"version": "4", "address": "192.168.7.9/24", "interface": 0},
            {"version": "4", "address": "192.168.7.9/24", "interface": 0},
        ],
    }
    assert result_ips(result) == ["192.168.7.9", "2001:db8::2"]
    assert result_ips({"cniVersion": "1.0.0"}) == []
    # Without interface indexes every address counts.
    assert result_ips({"ips": [{"address": "10.0.0.7/8"}]}) == ["10.0.0.7"]


def test_result_with_a_bad_address_is_an_error() -> None:
    with pytest.raises(Internal, match="invalid address"):
        result_ips({"ips": [{"address": "not-an-ip/24"}]})


async def test_del_runs_in_reverse_and_past_failures(fake_cni: FakeCni) -> None:
    error = {"cniVersion": "1.0.0", "code": 11, "msg": "try again later", "details": "locked"}
    fake_cni.write_conflist(
        [{"type": "first"}, {"type": "second", "error": error}, {"type": "third"}]
    )
    with pytest.raises(Internal) as failure:
        await network(fake_cni).delete(request(), timeout=10)

    assert [c["stdin"]["type"] for c in fake_cni.calls()] == ["third", "second", "first"]
    message = str(failure.value)
    assert "CNI plugin second" in message and "DEL" in message
    assert "try again later: locked (CNI error code 11)" in message


async def test_del_without_a_mounted_netns_passes_an_empty_cni_netns(
    fake_cni: FakeCni, tmp_path: Path
) -> None:
    fake_cni.write_conflist([{"type": "one"}])
    stale = tmp_path / "leftover-pin"
    stale.touch()
    await network(fake_cni).delete(request(netns=stale), timeout=10)
    assert fake_cni.calls()[0]["env"]["CNI_NETNS"] == ""


async def test_failed_add_names_the_plugin_and_cleans_up(fake_cni: FakeCni) -> None:
    error = {"cniVersion": "1.0.0", "code": 7, "msg": "bad config", "details": "no bridge"}
    fake_cni.write_conflist(
        [
            {"type": "main", "result": RESULT_1_0},
            {"type": "broken", "error": error, "stderr": "panic: oops", "failOn": ["ADD"]},
        ]
    )
    with pytest.raises(Internal) as failure:
        await network(fake_cni).add(request(), timeout=10)

    message = str(failure.value)
    assert "CNI plugin broken (network fake-net) ADD for pod shop/web-0 failed" in message
    assert "bad config: no bridge (CNI error code 7)" in message
    assert "stderr: panic: oops" in message
    # Both plugins may have allocated: both get a DEL, in reverse, with the last result.
    commands = [(c["command"], c["stdin"]["type"]) for c in fake_cni.calls()]
    assert commands == [("ADD", "main"), ("ADD", "broken"), ("DEL", "broken"), ("DEL", "main")]
    assert fake_cni.calls()[-1]["stdin"]["prevResult"] == RESULT_1_0


async def test_failed_cleanup_is_reported_too(fake_cni: FakeCni) -> None:
    error = {"cniVersion": "1.0.0", "code": 100, "msg": "always fails"}
    fake_cni.write_conflist([{"type": "broken", "error": error}])
    with pytest.raises(Internal, match="cleanup DEL also failed"):
        await network(fake_cni).add(request(), timeout=10)


async def test_plugin_output_that_is_not_a_result_is_an_error(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "noisy", "raw": "hello, not json"}])
    with pytest.raises(Internal, match="result is not JSON: hello, not json"):
        await network(fake_cni).add(request(), timeout=10)


async def test_plugin_that_prints_nothing_on_add_is_an_error(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "quiet", "raw": ""}])
    with pytest.raises(Internal, match="returned no result"):
        await network(fake_cni).add(request(), timeout=10)


async def test_timeout_kills_the_plugin_and_its_children(fake_cni: FakeCni) -> None:
    # The child keeps the plugin's stdout open: only killing the group ends the wait.
    fake_cni.write_conflist([{"type": "slow", "sleep": 60, "child": True}])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"CNI plugin slow .* killed"):
        await network(fake_cni).add(request(), timeout=1.0)
    assert time.monotonic() - started < 30  # not waited on for its 60 s

    calls = fake_cni.calls()
    plugin_pid = calls[0]["pid"]
    child_pid = next(c["pid"] for c in calls if c["command"] == "child")
    await until(lambda: not alive(plugin_pid) and not alive(child_pid))
    # The timed-out ADD was undone with a DEL.
    assert calls[-1]["command"] == "DEL"


async def test_plugin_timeout_caps_each_call(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "slow", "sleep": 60}])
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await network(fake_cni, plugin_timeout=0.5).add(request(), timeout=300)
    assert time.monotonic() - started < 30  # not waited on for its 60 s


async def test_cancelled_add_kills_the_plugin(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "slow", "sleep": 60}])
    task = asyncio.create_task(network(fake_cni).add(request(), timeout=300))
    await until(lambda: bool(fake_cni.calls()))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not alive(fake_cni.calls()[0]["pid"]))


async def test_bad_pod_metadata_is_rejected_before_any_plugin_runs(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "one"}])
    with pytest.raises(InvalidArgument, match="K8S_POD_NAME"):
        await network(fake_cni).add(request(name="a;b"), timeout=10)
    with pytest.raises(InvalidArgument, match="1-65535"):
        bad = [{"hostPort": 70000, "containerPort": 80}]
        await network(fake_cni).add(request(port_mappings=bad), timeout=10)
    assert fake_cni.calls() == []


async def test_delete_uses_the_config_of_the_add(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "old-plugin", "result": RESULT_1_0}], name="bootstrap")
    net = network(fake_cni)
    added = await net.add(request(), timeout=10)

    # A CNI daemonset replaces the network after the pod was attached.
    for path in fake_cni.config_dir.iterdir():
        path.unlink()
    fake_cni.write_conflist([{"type": "new-plugin"}], name="calico", filename="05-new.conflist")
    assert network_name(net) == "calico"

    await net.delete(request(), 10, prev_result=added.raw, config=added.config)
    last = fake_cni.calls()[-1]
    assert (last["command"], last["stdin"]["type"]) == ("DEL", "old-plugin")
    assert last["stdin"]["name"] == "bootstrap"


async def test_check_runs_in_order_with_the_add_result(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "one", "result": RESULT_1_0}, {"type": "two"}])
    net = network(fake_cni)
    await net.check(request(), 10, prev_result=RESULT_1_0)
    assert [(c["command"], c["stdin"]["type"]) for c in fake_cni.calls()] == [
        ("CHECK", "one"),
        ("CHECK", "two"),
    ]
    assert all(c["stdin"]["prevResult"] == RESULT_1_0 for c in fake_cni.calls())


async def test_check_is_skipped_when_the_config_disables_it(fake_cni: FakeCni) -> None:
    fake_cni.plugin("one")
    conflist = {
        "cniVersion": "1.0.0",
        "name": "n",
        "disableCheck": True,
        "plugins": [{"type": "one"}],
    }
    (fake_cni.config_dir / "10-n.conflist").write_text(json.dumps(conflist))
    await network(fake_cni).check(request(), 10, prev_result=RESULT_1_0)
    assert fake_cni.calls() == []


async def test_0_3_1_list_gets_no_prev_result_on_del(fake_cni: FakeCni) -> None:
    fake_cni.write_conflist([{"type": "one"}], version="0.3.1")
    await network(fake_cni).delete(request(), 10, prev_result=RESULT_1_0)
    assert "prevResult" not in fake_cni.calls()[0]["stdin"]
