"""Fields as kubelet sends them, taken as they are by the real daemon and seen by a real
container: no check at the edge may be stricter than what kubelet produces and the kernel
accepts (docs/validation.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon
from tests.integration.cri_testkit import (
    container_config,
    import_image,
    output,
    pod,
    run_to_exit,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

# kubelet with setHostnameAsFQDN and no cluster domain: `<hostname>.<subdomain>.<ns>.svc.`,
# the name node conformance expects inside the pod; and one of 64 bytes, the most kubelet
# sends (its fqdnMaxLen, the kernel's HOST_NAME_MAX).
FQDN_WITHOUT_CLUSTER_DOMAIN = "fqdn-pod-with-a-rather-long-host-name.headless.e2e-1234.svc."
FULL_LENGTH_FQDN = "h" * 41 + ".subdomain.default.svc."


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def _what_the_container_sees(daemon: Daemon, log_dir: Path, hostname: str) -> list[str]:
    script = "hostname; cat /proc/sys/kernel/hostname; echo $HOSTNAME; cat /etc/hostname"
    with pod(daemon, "fqdn", log_dir, hostname=hostname) as created:
        st = run_to_exit(daemon, created, container_config("show", script))
    assert st.exit_code == 0, output(st, "stderr")
    return output(st)


@pytest.mark.parametrize("hostname", [FQDN_WITHOUT_CLUSTER_DOMAIN, FULL_LENGTH_FQDN])
def test_a_pod_has_exactly_the_fqdn_kubelet_sends(
    daemon: Daemon, image: None, short_tmp: Path, hostname: str
) -> None:
    assert len(FQDN_WITHOUT_CLUSTER_DOMAIN) == 60 and len(FULL_LENGTH_FQDN) == 64
    assert _what_the_container_sees(daemon, short_tmp, hostname) == [hostname] * 4


@pytest.fixture
def no_pods_left(daemon: Daemon) -> Iterator[None]:
    yield
    items = daemon.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=10).items
    assert list(items) == []


@pytest.mark.parametrize(
    ("hostname", "reason"),
    [
        ("h" * 65, "65 bytes"),
        ("é" * 33, "66 bytes"),  # 33 characters, but the kernel counts bytes
        ("web\n10.0.0.1 kubernetes", "space or a control character"),
    ],
)
def test_a_hostname_the_kernel_or_etc_hosts_cannot_take_is_refused(
    daemon: Daemon, short_tmp: Path, no_pods_left: None, hostname: str, reason: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        with pod(daemon, "bad-host", short_tmp, hostname=hostname):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PodSandboxConfig.hostname" in refused.value.details()
    assert reason in refused.value.details()


def test_sysctls_resolver_settings_and_working_dir_as_kubelet_sends_them(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    """Each was refused at the edge; the kernel, the resolver and runc take them."""
    longest_search = ".".join(["a" * 63] * 3 + ["b" * 61]) + "."  # 253 and a trailing dot
    linux = api_pb2.LinuxPodSandboxConfig(
        sysctls={
            "kernel.sem": "250\n32000\n32\n128\n",
            "net.ipv4.ip_local_port_range": "2000 3000\n",
        }
    )
    dns = api_pb2.DNSConfig(
        servers=["10.96.0.10"],
        searches=["default.svc.cluster.local", longest_search],
        options=["ndots:5", "opt-" + "x" * 300],
    )
    script = (
        "cat /proc/sys/kernel/sem /proc/sys/net/ipv4/ip_local_port_range; pwd -P; "
        "grep -E '^(search|options) ' /etc/resolv.conf"
    )
    with pod(daemon, "kubelet-fields", short_tmp, linux=linux, dns_config=dns) as created:
        st = run_to_exit(
            daemon, created, container_config("show", script, working_dir="/tmp/../var/../etc")
        )
    assert st.exit_code == 0, output(st, "stderr")
    assert output(st) == [
        "250\t32000\t32\t128",
        "2000\t3000",
        "/etc",
        f"search default.svc.cluster.local {longest_search}",
        "options ndots:5 opt-" + "x" * 300,
    ]


def test_a_sysctl_runc_cannot_write_is_refused_before_the_pod_is_made(
    daemon: Daemon, short_tmp: Path, no_pods_left: None
) -> None:
    # runc 1.1 opened /proc/sys/net/ipv4/conf/eth0/100/rp_filter at the first container:
    # INTERNAL, with the pod made and never able to run anything.
    linux = api_pb2.LinuxPodSandboxConfig(sysctls={"net/ipv4/conf/eth0.100/rp_filter": "1"})
    with pytest.raises(grpc.RpcError) as refused:
        with pod(daemon, "vlan-sysctl", short_tmp, linux=linux):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "PodSandboxConfig.linux.sysctls['net/ipv4/conf/eth0.100/rp_filter']" in (
        refused.value.details()
    )
