"""Linux capability names and the container capability set as Kubernetes asks for it."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from cri_shim.errors import InvalidArgument

log = logging.getLogger(__name__)

# Index = capability number (include/uapi/linux/capability.h).
ALL_CAPABILITIES: tuple[str, ...] = tuple(
    f"CAP_{name}"
    for name in (
        "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
        "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
        "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
        "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
        "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
        "CHECKPOINT_RESTORE"
    ).split()
)

# The set CRI-O gives a container that asks for nothing: enough for a typical image that
# starts as root and drops to a service user, nothing that reaches beyond the container.
DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_KILL",
)


def capabilities_from_mask(mask: int) -> frozenset[str]:
    """Names of the bits set in a /proc/<pid>/status Cap* mask (unknown bits ignored)."""
    return frozenset(name for bit, name in enumerate(ALL_CAPABILITIES) if mask >> bit & 1)


def normalize_capability(name: str, field: str) -> str:
    """`net_admin`, `NET_ADMIN` and `CAP_NET_ADMIN` all mean CAP_NET_ADMIN."""
    upper = name.strip().upper()
    if upper == "ALL":
        return upper
    full = upper if upper.startswith("CAP_") else f"CAP_{upper}"
    if full not in ALL_CAPABILITIES:
        raise InvalidArgument(f"{field}: unknown capability {name!r}")
    return full


@dataclass(frozen=True)
class CapabilitySet:
    """The result: `granted` goes into the spec; `unavailable` is what the host's bounding
    set could not give (reported, never silently passed to runc to fail on)."""

    granted: tuple[str, ...]
    ambient: tuple[str, ...]
    unavailable: tuple[str, ...]


def resolve_capabilities(
    *,
    add: Iterable[str],
    drop: Iterable[str],
    add_ambient: Iterable[str],
    privileged: bool,
    bounding_set: frozenset[str],
    container: str = "container",
) -> CapabilitySet:
    """Apply Kubernetes add/drop semantics: start from the default set (every capability
    when privileged or when `ALL` is added), clear it when `ALL` is dropped, add the named
    ones, then drop the named ones, so that a capability both added and dropped ends up
    dropped. Finally intersect with the host's bounding set."""
    adds = [normalize_capability(n, "capabilities.add_capabilities") for n in add]
    drops = [normalize_capability(n, "capabilities.drop_capabilities") for n in drop]
    ambient_adds = [
        normalize_capability(n, "capabilities.add_ambient_capabilities") for n in add_ambient
    ]
    if "ALL" in ambient_adds:
        raise InvalidArgument("capabilities.add_ambient_capabilities: ALL is not allowed")

    if privileged or "ALL" in adds:
        wanted = list(ALL_CAPABILITIES)
    else:
        wanted = list(DEFAULT_CAPABILITIES)
    if "ALL" in drops and not privileged:
        wanted = []
    for name in adds:
        if name != "ALL" and name not in wanted:
            wanted.append(name)
    if not privileged:
        wanted = [name for name in wanted if name not in drops]
    # An ambient capability must also be permitted and inheritable, or the kernel refuses.
    for name in ambient_adds:
        if name not in wanted:
            wanted.append(name)

    granted = tuple(name for name in wanted if name in bounding_set)
    unavailable = tuple(name for name in wanted if name not in bounding_set)
    if unavailable:
        log.warning(
            "%s: capabilities not in the host's bounding set are left out: %s",
            container,
            ", ".join(unavailable),
        )
    ambient = tuple(name for name in ambient_adds if name in bounding_set)
    return CapabilitySet(granted=granted, ambient=ambient, unavailable=unavailable)
