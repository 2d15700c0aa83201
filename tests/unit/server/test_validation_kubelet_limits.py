"""The edge's checks against what kubelet can send and the kernel accepts: each value
here is one kubelet produces (docs/validation.md has the table), and each refused one is
past what the kernel or the file it lands in can take."""

from __future__ import annotations

import re

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.pod_rules import check_pod_sysctls
from cri_shim.server.validation import validate_request
from tests.unit.server.test_request_validation_and_limits import container, pod


# --- hostname ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "hostname",
    [
        # setHostnameAsFQDN with no cluster domain: `<host>.<subdomain>.<ns>.svc.`
        "web-0.headless.default.svc.",
        # ... up to the 64 bytes kubelet allows (its fqdnMaxLen)
        "h" * 41 + ".subdomain.default.svc.",
        # The cluster domain is kubelet's configuration, which it does not validate.
        "web-0.headless.default.svc.Cluster_Local.",
        # One label longer than DNS's 63: the kernel takes it (HOST_NAME_MAX is 64).
        "x" * 64,
    ],
)
def test_a_hostname_kubelet_sends_is_accepted(hostname: str) -> None:
    validate_request("RunPodSandbox", pod(hostname=hostname))


@pytest.mark.parametrize(
    ("hostname", "reason"),
    [
        ("h" * 65, "65 bytes"),
        ("é" * 33, "66 bytes"),
        ("web\n10.0.0.1 kubernetes", "space or a control character"),
        ("web host", "space or a control character"),
        ("web\tlocalhost", "space or a control character"),
    ],
)
def test_a_hostname_past_the_kernel_or_etc_hosts_is_refused(hostname: str, reason: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape("PodSandboxConfig.hostname")) as refused:
        validate_request("RunPodSandbox", pod(hostname=hostname))
    assert reason in str(refused.value)


# --- resolv.conf ------------------------------------------------------------------------
# A search domain of the pod's dnsConfig is a DNS subdomain of up to 253 characters, and
# Kubernetes allows it a trailing dot.
LONGEST_SEARCH = ".".join(["a" * 63] * 3 + ["b" * 61]) + "."


@pytest.mark.parametrize(
    "dns",
    [
        {"dns_config.searches": [LONGEST_SEARCH]},
        # kubelet passes the node's own search domains on, whatever they are.
        {"dns_config.searches": ["bücher.example", "-corp.example"]},
        # A pod's option name and value are free in Kubernetes, and their number too.
        {"dns_config.options": ["x" * 300 + ":1"]},
        {"dns_config.options": [f"opt{index}" for index in range(65)]},
    ],
)
def test_resolver_settings_kubelet_sends_are_accepted(dns: dict[str, object]) -> None:
    validate_request("RunPodSandbox", pod(**dns))


@pytest.mark.parametrize(
    ("dns", "named"),
    [
        ({"dns_config.searches": ["a.example\nnameserver 6.6.6.6"]}, "searches[0]"),
        ({"dns_config.searches": ["a.example b.example"]}, "searches[0]"),
        ({"dns_config.searches": [""]}, "searches[0]"),
        ({"dns_config.searches": ["a" * 2049]}, "searches[0]: longer than 2048"),
        ({"dns_config.searches": [f"s{index}" for index in range(65)]}, "searches"),
        ({"dns_config.options": ["ndots:1 rotate"]}, "options[0]"),
        ({"dns_config.options": ["ndots:1\rnameserver 6.6.6.6"]}, "options[0]"),
    ],
)
def test_resolver_settings_that_would_rewrite_resolv_conf_are_refused(
    dns: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(f"dns_config.{named}")):
        validate_request("RunPodSandbox", pod(**dns))


# --- sysctls ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sysctls",
    [
        # The kernel reads a newline as a space: a YAML block scalar's value is fine.
        {"kernel.sem": "250\n32000\n32\n128\n"},
        {"net.ipv4.ip_local_port_range": "1024 65000\n"},
        # The kernel takes a value of any size (under kmalloc's) and parses it.
        {"kernel.sem": "250 32000 32 128" + " " * 5000},
    ],
)
def test_sysctls_kubelet_sends_are_accepted(sysctls: dict[str, str]) -> None:
    request = pod(**{"linux.sysctls": sysctls})
    validate_request("RunPodSandbox", request)
    check_pod_sysctls(request.config)


@pytest.mark.parametrize(
    "name", ["net/ipv4/conf/eth0.100/rp_filter", "net.ipv4.conf.eth0/100.rp_filter"]
)
def test_a_sysctl_runc_would_write_to_the_wrong_file_is_refused(name: str) -> None:
    # Either form names /proc/sys/net/ipv4/conf/eth0.100/rp_filter; runc 1.1 opens
    # .../eth0/100/rp_filter, at the pod's first container.
    with pytest.raises(InvalidArgument, match=re.escape("runc writes every '.' as a '/'")):
        validate_request("RunPodSandbox", pod(**{"linux.sysctls": {name: "1"}}))


# --- labels -----------------------------------------------------------------------------
def test_labels_have_no_total_kubernetes_does_not_have() -> None:
    # 4000 labels, each within Kubernetes' limits (a 317-byte key, a 63-byte value): 1.4 MB.
    labels = {f"example.com/{'k' * 50}-{index:04}": "v" * 63 for index in range(4000)}
    validate_request("RunPodSandbox", pod(labels=labels))
    request = container(labels=labels)
    validate_request("CreateContainer", request)


def test_annotations_keep_kubernetes_total() -> None:
    annotations = {f"note-{index}": "x" * 1024 for index in range(300)}
    with pytest.raises(InvalidArgument, match=r"annotations: .* more than the 262144 allowed"):
        validate_request("RunPodSandbox", pod(annotations=annotations))


# --- paths ------------------------------------------------------------------------------
def test_a_working_dir_with_dotdot_is_accepted() -> None:
    # Kubernetes leaves workingDir free, and runc resolves it inside the root filesystem.
    validate_request("CreateContainer", container(working_dir="/srv/app/../data"))


def test_a_relative_working_dir_is_refused() -> None:
    # runc refuses a relative cwd: refused here, naming the field, not deep in runc.
    with pytest.raises(InvalidArgument, match="working_dir: 'srv' must be an absolute path"):
        validate_request("CreateContainer", container(working_dir="srv"))
