"""The host's routes, read from the kernel's text tables (`/proc/net/route`, `ipv6_route`).

The main routing table of the reader's network namespace, IPv4 and IPv6: enough to tell
which interface the host sends a subnet through. A read of these files costs well under a
millisecond on a node with a few hundred routes, with no netlink library to load.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

PROC_NET = Path("/proc/net")
# linux/route.h
RTF_UP = 0x0001
RTF_REJECT = 0x0200


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
        address = socket.inet_ntoa(struct.pack("=I", int(fields[1], 16)))
        netmask = socket.inet_ntoa(struct.pack("=I", int(fields[7], 16)))
        network = ipaddress.IPv4Network(f"{address}/{netmask}", strict=False)
        routes.append(Route(network, fields[0]))
    return routes


def _ipv6_routes(text: str) -> list[Route]:
    routes: list[Route] = []
    # destination, its prefix length, source, its length, next hop, metric, refcount, use,
    # flags, interface; addresses as 32 hex digits in network order.
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10:
            continue
        flags = int(fields[8], 16)
        if not flags & RTF_UP or flags & RTF_REJECT or fields[9] == "lo":
            continue
        address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        network = ipaddress.IPv6Network(f"{address}/{int(fields[1], 16)}", strict=False)
        routes.append(Route(network, fields[9]))
    return routes


def host_routes(proc_net: Path = PROC_NET) -> list[Route]:
    """The usable routes of the main table (rejecting ones left out), IPv4 then IPv6;
    `proc_net` is another namespace's `/proc/PID/net`. A table that cannot be read (no
    IPv6 on this kernel) contributes nothing."""
    routes: list[Route] = []
    for name, parse in (("route", _ipv4_routes), ("ipv6_route", _ipv6_routes)):
        try:
            text = (proc_net / name).read_text()
        except OSError:
            continue
        routes += parse(text)
    return routes
