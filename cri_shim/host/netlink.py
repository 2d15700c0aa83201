"""rtnetlink requests, encoded by hand: the one the daemon sends is a few fixed fields.

pyroute2 (the netlink library this used) costs about 11 MiB resident once imported, which
every daemon that runs a pod network paid for one 32-byte message; `struct` does it.

A netlink socket belongs to the network namespace of the thread that opens it, so a
request made from a thread inside a pod's namespace talks to that namespace without
forking into it. The message is sent on a plain socket rather than through a library's
socket object, which costs more than the request itself (DESIGN §6).
"""

from __future__ import annotations

import errno
import os
import socket
import struct

# In a fresh network namespace `lo` is always ifindex 1.
LOOPBACK_INDEX = 1

# linux/netlink.h, linux/rtnetlink.h, linux/if.h
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
RTM_NEWLINK = 16
IFF_UP = 0x1
_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_IFINFOMSG = struct.Struct("=BxHiII")  # family, (pad), device type, index, flags, change
_ERROR = struct.Struct("=i")  # nlmsgerr.error: 0 (the ACK) or minus an errno


def loopback_up() -> None:
    """Bring up `lo` in the calling thread's network namespace. Raises OSError."""
    body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, LOOPBACK_INDEX, IFF_UP, IFF_UP)
    header = _NLMSGHDR.pack(
        _NLMSGHDR.size + len(body), RTM_NEWLINK, NLM_F_REQUEST | NLM_F_ACK, 1, 0
    )
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
    ) as sock:
        sock.sendto(header + body, (0, 0))
        reply = sock.recv(65536)
    if len(reply) < _NLMSGHDR.size + _ERROR.size:
        raise OSError(errno.EPROTO, f"bring up lo: short netlink reply ({len(reply)} bytes)")
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if kind != NLMSG_ERROR:
        raise OSError(errno.EPROTO, f"bring up lo: unexpected netlink reply of type {kind}")
    (error,) = _ERROR.unpack_from(reply, _NLMSGHDR.size)
    if error:
        raise OSError(-error, f"bring up lo: {os.strerror(-error)}")
