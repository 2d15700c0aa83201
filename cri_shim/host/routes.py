"""The host's routes, read from the kernel's text tables (`/proc/net/route`, `ipv6_route`).

The main routing table of the reader's network namespace, IPv4 and IPv6: enough to tell
which interface the host sends a subnet through, with no netlink library to load. A route
costs a few microseconds to parse; a bridge network's node has a handful of them (IPv6's
link-local and multicast routes, one per pod interface, are skipped unparsed).
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

PROC_NET = Path("/proc/net")
# linux/route.h
RTF_UP = 0x0001
RTF_REJECT = 0x0200
_LINK_LOCAL_OR_MULTICAST = ("fe8", "fe9", "fea", "feb", "ff")  # fe80::/10, ff00::/8


@dataclass(frozen=True)
class Route:
    """A route to `network` through `interface`."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    interface: str


def _ipv4_routes(text: str) -> list[Route]:
    routes: list[Route] = []
    # Iface Destination Gateway Flags RefCnt Use Metric Mask MTU Window IRTT; the
    # addresses are the kernel's 32-bit words in hex, in the host's byte order.
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = int(fields[3], 16)
        if not flags & RTF_UP or flags & RTF_REJECT:
            continue
        # From integers: parsing dotted text costs several times as much, per route.
        address = int.from_bytes(struct.pack("=I", int(fields[1], 16)), "big")
        netmask = int.from_bytes(struct.pack("=I", int(fields[7], 16)), "big")
        network = ipaddress.IPv4Network((address & netmask, netmask.bit_count()))
        routes.append(Route(network, fields[0]))
    return routes


def _ipv6_routes(text: str) -> list[Route]:
    routes: list[Route] = []
    # destination, its prefix length, source, its length, next hop, metric, refcount, use,
    # flags, interface; addresses as 32 hex digits in network order.
    for line in text.splitlines():
        fields = line.split()
        # Each interface has its link-local and multicast routes, a node a few per pod:
        # skipped before any parsing, no pod network is there.
        if len(fields) < 10 or fields[0].startswith(_LINK_LOCAL_OR_MULTICAST):
            continue
        flags = int(fields[8], 16)
        if not flags & RTF_UP or flags & RTF_REJECT or fields[9] == "lo":
            continue
        network = ipaddress.IPv6Network((int(fields[0], 16), int(fields[1], 16)), strict=False)
        routes.append(Route(network, fields[9]))
    return routes


def host_routes(versions: Collection[int] = (4, 6), proc_net: Path = PROC_NET) -> list[Route]:
    """The usable routes of the IP `versions` asked for (rejecting ones, and IPv6's
    link-local and multicast ones, left out), IPv4 then IPv6; `proc_net` is another
    namespace's `/proc/PID/net`. A table that cannot be read (no IPv6 on this kernel)
    contributes nothing."""
    routes: list[Route] = []
    for version, name, parse in ((4, "route", _ipv4_routes), (6, "ipv6_route", _ipv6_routes)):
        if version not in versions:
            continue
        try:
            text = (proc_net / name).read_text()
        except OSError:
            continue
        routes += parse(text)
    return routes
