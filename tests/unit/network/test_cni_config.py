"""Which network configuration the CNI runner picks, and what NetworkReady says about it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cni_support import network_name
from fake_cni import FakeCni

from cri_shim.errors import Unavailable
from cri_shim.network.cni import (
    NOT_READY_REASON,
    CniNetwork,
    ConfigProblem,
    PodNetworkRequest,
    parse_network_config,
)

BUNDLED = Path(__file__).resolve().parents[3] / "cni"


def network(fake: FakeCni, fallback: Path | None = None) -> CniNetwork:
    return CniNetwork(fake.config_dir, [fake.bin_dir], fallback)


def conflist(name: str, *types: str) -> str:
    plugins = [{"type": t} for t in types]
    return json.dumps({"cniVersion": "1.0.0", "name": name, "plugins": plugins})


def test_first_file_in_lexical_order_wins(fake_cni: FakeCni) -> None:
    fake_cni.plugin("fake")
    # Lexical, not numeric: "10-" sorts before "9-".
    (fake_cni.config_dir / "9-nine.conflist").write_text(conflist("nine", "fake"))
    (fake_cni.config_dir / "10-ten.conflist").write_text(conflist("ten", "fake"))
    assert network_name(network(fake_cni)) == "ten"


def test_files_without_a_config_suffix_are_ignored(fake_cni: FakeCni) -> None:
    fake_cni.plugin("fake")
    (fake_cni.config_dir / "00-notes.txt").write_text("not a config")
    (fake_cni.config_dir / "01-old.conflist.bak").write_text("{broken")
    (fake_cni.config_dir / "50-real.json").write_text(conflist("real", "fake"))
    net = network(fake_cni)
    assert net.status() == (True, "", "")
    assert network_name(net) == "real"


def test_single_conf_is_wrapped_into_a_list(fake_cni: FakeCni) -> None:
    fake_cni.plugin("fake")
    single = {"cniVersion": "0.4.0", "name": "single", "type": "fake", "bridge": "x0"}
    (fake_cni.config_dir / "10-single.conf").write_text(json.dumps(single))
    net = network(fake_cni)
    assert net.status()[0]
    assert network_name(net) == "single"
    conf = parse_network_config(single)
    assert conf.cni_version == "0.4.0"
    assert conf.plugins == [{"type": "fake", "bridge": "x0"}]


def test_fallback_used_only_when_config_dir_has_no_config(
    fake_cni: FakeCni, tmp_path: Path
) -> None:
    fake_cni.plugin("fake")
    fallback = tmp_path / "bundled"
    fallback.mkdir()
    (fallback / "10-bundled.conflist").write_text(conflist("bundled", "fake"))
    net = network(fake_cni, fallback)
    assert network_name(net) == "bundled"

    (fake_cni.config_dir / "20-operator.conflist").write_text(conflist("operator", "fake"))
    assert network_name(net) == "operator"


def test_missing_config_dir_falls_back(fake_cni: FakeCni, tmp_path: Path) -> None:
    fake_cni.plugin("fake")
    fallback = tmp_path / "bundled"
    fallback.mkdir()
    (fallback / "10-bundled.conflist").write_text(conflist("bundled", "fake"))
    net = CniNetwork(tmp_path / "does-not-exist", [fake_cni.bin_dir], fallback)
    assert net.status() == (True, "", "")


def test_no_config_anywhere_is_not_ready(fake_cni: FakeCni, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    ready, reason, message = network(fake_cni, empty).status()
    assert not ready
    assert reason == NOT_READY_REASON
    assert str(fake_cni.config_dir) in message and str(empty) in message


def test_broken_json_is_not_ready_with_a_message_naming_the_file(
    fake_cni: FakeCni, tmp_path: Path
) -> None:
    fake_cni.plugin("fake")
    broken = fake_cni.config_dir / "10-broken.conflist"
    broken.write_text('{"cniVersion": "1.0.0", "name": ')
    # A broken first file must not let a later file or the fallback take over silently.
    (fake_cni.config_dir / "20-good.conflist").write_text(conflist("good", "fake"))
    fallback = tmp_path / "bundled"
    fallback.mkdir()
    (fallback / "10-bundled.conflist").write_text(conflist("bundled", "fake"))

    net = network(fake_cni, fallback)
    ready, reason, message = net.status()
    assert (ready, reason) == (False, NOT_READY_REASON)
    assert str(broken) in message and "JSON" in message
    assert network_name(net) == ""


async def test_add_on_a_network_that_is_not_ready_is_unavailable(fake_cni: FakeCni) -> None:
    (fake_cni.config_dir / "10-broken.conflist").write_text("{")
    req = PodNetworkRequest("p1", Path("/nonexistent"), "web", "default", "uid-1", [])
    with pytest.raises(Unavailable, match=r"10-broken\.conflist"):
        await network(fake_cni).add(req, timeout=5)
    assert fake_cni.calls() == []


@pytest.mark.parametrize(
    ("data", "fault"),
    [
        ({"cniVersion": "0.2.0", "name": "n", "plugins": [{"type": "fake"}]}, "cniVersion"),
        ({"cniVersion": "1.0.0", "name": "n", "plugins": []}, "plugins"),
        ({"cniVersion": "1.0.0", "plugins": [{"type": "fake"}]}, "name"),
        ({"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "../bin/sh"}]}, "type"),
        ({"cniVersion": "1.0.0", "name": "n"}, "plugins"),
        ([1, 2], "JSON object"),
    ],
)
def test_invalid_configs_are_rejected_with_the_fault(data: object, fault: str) -> None:
    with pytest.raises(ConfigProblem, match=fault):
        parse_network_config(data)


def test_missing_plugin_binary_is_not_ready(fake_cni: FakeCni) -> None:
    fake_cni.plugin("present")
    (fake_cni.config_dir / "10-n.conflist").write_text(conflist("n", "present", "absent"))
    ready, reason, message = network(fake_cni).status()
    assert (ready, reason) == (False, NOT_READY_REASON)
    assert "absent" in message and str(fake_cni.bin_dir) in message
    assert "present," not in message


def test_status_picks_up_config_changes_without_reload(fake_cni: FakeCni) -> None:
    fake_cni.plugin("fake")
    net = network(fake_cni)
    assert not net.status()[0]

    path = fake_cni.config_dir / "10-n.conflist"
    path.write_text(conflist("first", "fake"))
    assert net.status() == (True, "", "")
    assert network_name(net) == "first"

    # Rewritten in place (same directory listing): the file's own stat must be noticed.
    path.write_text(conflist("second-name", "fake"))
    os.utime(path, ns=(1, 1))
    assert network_name(net) == "second-name"


def test_bundled_conflist_is_a_bridge_with_portmap() -> None:
    files = sorted(BUNDLED.glob("*.conflist"))
    assert [f.name for f in files] == ["10-cri-shim-bridge.conflist"]
    conf = parse_network_config(json.loads(files[0].read_text()), files[0])
    assert conf.cni_version == "1.0.0"
    bridge, portmap = conf.plugins
    assert bridge["type"] == "bridge" and bridge["bridge"] == "cri-shim0"
    assert bridge["isGateway"] and bridge["ipMasq"]
    assert bridge["ipam"]["type"] == "host-local"
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.88.0.0/16"}]]
    assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True}


@pytest.mark.skipif(not Path("/usr/lib/cni/bridge").exists(), reason="CNI plugins not installed")
def test_bundled_conflist_is_ready_with_the_installed_plugins(tmp_path: Path) -> None:
    # Whatever this host routes: test_cni_subnet_conflict.py is about that.
    net = CniNetwork(tmp_path / "empty", [Path("/usr/lib/cni")], BUNDLED, routes=lambda _: [])
    assert net.status() == (True, "", "")
    assert network_name(net) == "cri-shim"
