"""What a pod's configuration means, whoever asks: whether it runs on the host's network,
its hostname, and which sysctls its own namespaces let it set. The sandbox's creation
(which refuses a pod's sysctls before it exists) and the OCI spec builder apply the same
rules from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument

# The sysctls an IPC namespace isolates (besides fs.mqueue.*), and a UTS namespace.
_IPC_SYSCTLS = frozenset(
    {
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
    }
)
_UTS_SYSCTLS = frozenset({"kernel.hostname", "kernel.domainname"})


def host_network(config: api_pb2.PodSandboxConfig) -> bool:
    options = config.linux.security_context.namespace_options
    return bool(options.network == api_pb2.NODE)


def pod_hostname(config: api_pb2.PodSandboxConfig, sandbox_id: str) -> str:
    """The pod's hostname: the one asked for; else, as CRI-O does, the node's for a
    host-network pod and the sandbox ID's first 12 characters for a pod with its own UTS
    namespace (a pod's name may be longer than a hostname may be)."""
    if config.hostname:
        return config.hostname
    if host_network(config):
        return os.uname().nodename
    return sandbox_id[:12]


def namespaced_sysctls(
    sysctls: Mapping[str, str], *, own_network: bool, own_ipc: bool, own_uts: bool
) -> dict[str, str]:
    """Only sysctls that the pod's own namespaces isolate, by their dotted names; setting
    any other would change the whole node."""
    out: dict[str, str] = {}
    for raw_name, value in sysctls.items():
        name = _normalize_sysctl(raw_name)
        if name.startswith("net."):
            if not own_network:
                raise InvalidArgument(
                    f"sysctls: {raw_name} cannot be set in a pod on the host network"
                )
        elif name in _IPC_SYSCTLS or name.startswith("fs.mqueue."):
            if not own_ipc:
                raise InvalidArgument(f"sysctls: {raw_name} cannot be set in a pod with host IPC")
        elif name in _UTS_SYSCTLS:
            if not own_uts:
                raise InvalidArgument(f"sysctls: {raw_name} cannot be set in a pod with host UTS")
        else:
            raise InvalidArgument(f"sysctls: {raw_name} is not a namespaced sysctl")
        out[name] = value
    return out


def check_pod_sysctls(
    config: api_pb2.PodSandboxConfig, field: str = "PodSandboxConfig.linux.sysctls"
) -> None:
    """Only sysctls that the pod's own namespaces isolate (net.* only off the host
    network, IPC ones only with a private IPC namespace): refused before the pod exists
    rather than at its first container."""
    hostnet = host_network(config)
    try:
        namespaced_sysctls(
            config.linux.sysctls,
            own_network=not hostnet,
            own_ipc=config.linux.security_context.namespace_options.ipc != api_pb2.NODE,
            own_uts=not hostnet,
        )
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}: {str(exc).removeprefix('sysctls: ')}") from None


def _normalize_sysctl(name: str) -> str:
    # Kubernetes accepts "net/ipv4/ip_forward"; with slashes as separators a dot is part of
    # a name component (an interface name such as "eth0.100").
    if "/" in name and (("." not in name) or name.index("/") < name.index(".")):
        return name.replace(".", "\0").replace("/", ".").replace("\0", "/")
    return name
