"""The edge's checks against what kubelet can send and the kernel accepts: each value
here is one kubelet produces (docs/validation.md has the table), and each refused one is
past what the kernel or the file it lands in can take."""

from __future__ import annotations

import re

import pytest

from cri_shim.errors import InvalidArgument
from cri_shim.server.validation import validate_request
from tests.unit.server.test_request_validation_and_limits import pod


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
