"""Pod sandboxes against the real daemon, real CNI plugins and real namespaces.

The RPC sequence is the one `crictl runp / inspectp / pods / stopp / rmp` sends.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import CniTestNetwork, Daemon, ping, pod_config

pytestmark = [pytest.mark.integration, pytest.mark.root]


def run_pod(daemon: Daemon, config: api_pb2.PodSandboxConfig, timeout: float = 30) -> str:
    response = daemon.runtime().RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=config), timeout=timeout
    )
    return response.pod_sandbox_id


def status(
    daemon: Daemon, sandbox_id: str, verbose: bool = False
) -> api_pb2.PodSandboxStatusResponse:
    return daemon.runtime().PodSandboxStatus(
        api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose), timeout=10
    )


def uts_hostname(info: dict[str, str]) -> str:
    """The hostname set in a sandbox's pinned UTS namespace (its verbose info's `utsns`)."""
    return subprocess.run(
        ["nsenter", f"--uts={info['utsns']}", "hostname"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_version_and_status(daemon: Daemon) -> None:
    version = daemon.runtime().Version(api_pb2.VersionRequest(), timeout=5)
    assert version.runtime_name == "cri-shim"
    assert version.runtime_api_version == "v1"
    assert version.version and version.runtime_version
    conditions = {
        c.type: c
        for c in daemon.runtime().Status(api_pb2.StatusRequest(), timeout=5).status.conditions
    }
    assert conditions["RuntimeReady"].status
    assert conditions["NetworkReady"].status
    config = daemon.runtime().RuntimeConfig(api_pb2.RuntimeConfigRequest(), timeout=5)
    assert config.linux.cgroup_driver == api_pb2.CGROUPFS


def test_network_not_ready_without_cni_config(daemon: Daemon, test_network: CniTestNetwork) -> None:
    for f in test_network.config_dir.iterdir():
        f.unlink()
    (test_network.config_dir / "broken.conflist").write_text("{not json")
    conditions = {
        c.type: c
        for c in daemon.runtime().Status(api_pb2.StatusRequest(), timeout=5).status.conditions
    }
    assert not conditions["NetworkReady"].status
    assert conditions["NetworkReady"].reason
    assert conditions["NetworkReady"].message


def test_pod_lifecycle_like_crictl(
    daemon: Daemon, test_network: CniTestNetwork, short_tmp: Path
) -> None:
    log_dir = short_tmp / "pod-logs"
    config = pod_config(
        "web",
        hostname="web-host",
        log_directory=str(log_dir),
        dns_config=api_pb2.DNSConfig(
            servers=["10.0.0.10"], searches=["svc.local"], options=["ndots:5"]
        ),
    )
    sandbox_id = run_pod(daemon, config)
    assert len(sandbox_id) == 64

    # inspectp
    st = status(daemon, sandbox_id, verbose=True)
    assert st.status.state == api_pb2.SANDBOX_READY
    assert st.status.metadata.name == "web"
    assert st.status.labels["app"] == "web"
    assert st.status.annotations["note"] == "test"
    assert st.status.created_at > 0
    ip = st.status.network.ip
    assert ip.startswith(test_network.subnet.rsplit(".", 1)[0])
    info = json.loads(st.info["info"])
    assert ping(ip), f"pod IP {ip} does not answer"
    # The pinned UTS namespace carries the pod's hostname.
    assert uts_hostname(info) == "web-host"
    sandbox_dir = Path(info["sandboxDir"])
    assert (sandbox_dir / "resolv.conf").read_text() == (
        "nameserver 10.0.0.10\nsearch svc.local\noptions ndots:5\n"
    )
    assert (sandbox_dir / "hostname").read_text() == "web-host\n"
    assert log_dir.is_dir()

    # a unique prefix works as crictl users expect
    assert status(daemon, sandbox_id[:12]).status.id == sandbox_id

    # pods
    items = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=5).items
    assert [i.id for i in items] == [sandbox_id]

    # stopp: network gone, still listed as not ready
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    st = status(daemon, sandbox_id)
    assert st.status.state == api_pb2.SANDBOX_NOTREADY
    assert not ping(ip)
    assert test_network.allocations() == []
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )

    # rmp: nothing left
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=5).items == []
    assert daemon.leaks() == {}
    assert not sandbox_dir.exists()
    # idempotent
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    daemon.runtime().StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id="f" * 64), timeout=30
    )


def test_remove_without_stop_tears_everything_down(daemon: Daemon) -> None:
    sandbox_id = run_pod(daemon, pod_config("quick"))
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.leaks() == {}


def test_list_filters(daemon: Daemon) -> None:
    a = run_pod(daemon, pod_config("a", uid="ua", labels={"tier": "front"}))
    b = run_pod(daemon, pod_config("b", uid="ub", labels={"tier": "back"}))
    daemon.runtime().StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=b), timeout=30)

    def ids(f: api_pb2.PodSandboxFilter) -> list[str]:
        return [
            i.id
            for i in daemon.runtime()
            .ListPodSandbox(api_pb2.ListPodSandboxRequest(filter=f), timeout=5)
            .items
        ]

    assert ids(api_pb2.PodSandboxFilter(id=a)) == [a]
    assert ids(api_pb2.PodSandboxFilter(id=a[:10])) == [a]
    ready = api_pb2.PodSandboxStateValue(state=api_pb2.SANDBOX_READY)
    assert ids(api_pb2.PodSandboxFilter(state=ready)) == [a]
    assert ids(api_pb2.PodSandboxFilter(label_selector={"tier": "back"})) == [b]
    assert ids(api_pb2.PodSandboxFilter(label_selector={"tier": "none"})) == []
    for sandbox_id in (a, b):
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
        )
    assert daemon.leaks() == {}


def test_host_network_pod_skips_netns_and_cni(daemon: Daemon, test_network: CniTestNetwork) -> None:
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(network=api_pb2.NODE)
        )
    )
    sandbox_id = run_pod(daemon, pod_config("hostnet", linux=linux))
    st = status(daemon, sandbox_id, verbose=True)
    assert st.status.network.ip == ""
    assert json.loads(st.info["info"])["netns"] == ""
    assert test_network.adds() == 0
    assert st.status.linux.namespaces.options.network == api_pb2.NODE
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.leaks() == {}


def test_a_pod_without_hostname_is_named_after_its_id(daemon: Daemon) -> None:
    # critest's pod names are longer than a hostname may be, and kubelet may send none.
    config = pod_config("PodSandbox-for-a-long-test-name-" + "x" * 60, hostname="")
    sandbox_id = run_pod(daemon, config)
    info = json.loads(status(daemon, sandbox_id, verbose=True).info["info"])
    assert uts_hostname(info) == sandbox_id[:12]
    sandbox_dir = Path(info["sandboxDir"])
    assert (sandbox_dir / "hostname").read_text() == sandbox_id[:12] + "\n"
    linux = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(network=api_pb2.NODE)
        )
    )
    host_id = run_pod(daemon, pod_config("hostnet-nameless", hostname="", linux=linux))
    host_dir = Path(json.loads(status(daemon, host_id, verbose=True).info["info"])["sandboxDir"])
    assert (host_dir / "hostname").read_text() == os.uname().nodename + "\n"
    for pod_id in (sandbox_id, host_id):
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=30
        )
    assert daemon.leaks() == {}


def test_restart_keeps_sandbox_with_its_ip(daemon: Daemon) -> None:
    sandbox_id = run_pod(daemon, pod_config("keeper"))
    ip = status(daemon, sandbox_id).status.network.ip
    daemon.restart()
    st = status(daemon, sandbox_id)
    assert st.status.state == api_pb2.SANDBOX_READY
    assert st.status.network.ip == ip
    assert ping(ip)
    # the same request again returns the same sandbox (no second attachment)
    assert run_pod(daemon, pod_config("keeper")) == sandbox_id
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.leaks() == {}


@pytest.mark.parametrize("field", ["name", "uid", "namespace"])
def test_missing_metadata_is_invalid_argument(daemon: Daemon, field: str) -> None:
    config = pod_config("x")
    setattr(config.metadata, field, "")
    with pytest.raises(grpc.RpcError) as info:
        run_pod(daemon, config)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    assert daemon.leaks() == {}


def test_unknown_runtime_handler_is_invalid_argument(daemon: Daemon) -> None:
    with pytest.raises(grpc.RpcError) as info:
        daemon.runtime().RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=pod_config("x"), runtime_handler="kata"), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kata" in info.value.details()


def test_status_of_unknown_sandbox_is_not_found(daemon: Daemon) -> None:
    with pytest.raises(grpc.RpcError) as info:
        status(daemon, "0123456789abcdef")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_cni_failure_returns_plugin_message_and_leaves_nothing(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    test_network.fail_file.write_text("injected failure from the test plugin")
    with pytest.raises(grpc.RpcError) as info:
        run_pod(daemon, pod_config("broken"))
    assert "injected failure from the test plugin" in info.value.details()
    assert daemon.leaks() == {}
    # the name is free again: the next attempt succeeds
    test_network.fail_file.unlink()
    sandbox_id = run_pod(daemon, pod_config("broken"))
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.leaks() == {}


def test_unimplemented_rpcs_say_so(daemon: Daemon) -> None:
    with pytest.raises(grpc.RpcError) as info:
        daemon.runtime().CheckpointContainer(api_pb2.CheckpointContainerRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "CheckpointContainer" in info.value.details()


def test_update_runtime_config_leaves_addressing_to_cni(
    daemon: Daemon, test_network: CniTestNetwork
) -> None:
    # kubelet sends the pod CIDR at start; the CNI configuration owns addressing here.
    response = daemon.runtime().UpdateRuntimeConfig(
        api_pb2.UpdateRuntimeConfigRequest(
            runtime_config=api_pb2.RuntimeConfig(
                network_config=api_pb2.NetworkConfig(pod_cidr="10.1.0.0/16")
            )
        ),
        timeout=5,
    )
    assert response == api_pb2.UpdateRuntimeConfigResponse()
    assert "kubelet reports pod CIDR 10.1.0.0/16" in daemon.log()
    sandbox_id = run_pod(daemon, pod_config("addressed"))
    ip = ipaddress.ip_address(status(daemon, sandbox_id).status.network.ip)
    assert ip in ipaddress.ip_network(test_network.subnet), (ip, test_network.subnet)
    assert ip not in ipaddress.ip_network("10.1.0.0/16")
    daemon.runtime().RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=30
    )
    assert daemon.leaks() == {}


def test_socket_mode_and_graceful_stop(daemon: Daemon) -> None:
    assert os.stat(daemon.socket).st_mode & 0o777 == 0o660
    assert daemon.stop() == 0
