"""Interface counters of a pod's network namespace (`/proc/net/dev` as the pod sees it).

`/proc/<pid>/net/dev` would need a live process in the pod, and a pod whose containers
have all exited still has a network. So a short-lived thread of its own enters the
pinned namespace (setns affects only the calling thread), reads
`/proc/thread-self/net/dev`, and goes back. The thread is never reused: should the way
back fail, it ends in the pod's namespace and nothing else ever runs there. No process
is forked (which a gRPC daemon must avoid) and nothing is mounted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from cri_shim.host.namespaces import netns_entered

# Generous: entering a namespace and reading one file takes well under a millisecond.
READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class InterfaceCounters:
    rx_bytes: int
    rx_packets: int
    rx_errors: int
    rx_dropped: int
    tx_bytes: int
    tx_packets: int
    tx_errors: int
    tx_dropped: int


def parse_net_dev(text: str) -> dict[str, InterfaceCounters]:
    """`/proc/net/dev`: two header lines, then `name: rx(8 fields) tx(8 fields)`."""
    counters = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or len(fields) < 16:
            continue
        try:
            values = [int(v) for v in fields[:16]]
        except ValueError:
            continue
        counters[name.strip()] = InterfaceCounters(
            rx_bytes=values[0],
            rx_packets=values[1],
            rx_errors=values[2],
            rx_dropped=values[3],
            tx_bytes=values[8],
            tx_packets=values[9],
            tx_errors=values[10],
            tx_dropped=values[11],
        )
    return counters


def read_netns_counters(netns: Path) -> dict[str, InterfaceCounters]:
    """Counters of every interface but loopback in the namespace pinned at `netns`.
    Blocking (about a millisecond): call it from a worker thread."""
    result: list[dict[str, InterfaceCounters]] = []
    failure: list[BaseException] = []

    def work() -> None:
        try:
            result.append(_read_inside(netns))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=work, name="netdev-reader", daemon=True)
    thread.start()
    thread.join(READ_TIMEOUT)
    if failure:
        raise failure[0]
    if not result:
        raise TimeoutError(f"reading interface counters of {netns} took over {READ_TIMEOUT}s")
    return {name: c for name, c in result[0].items() if name != "lo"}


def _read_inside(netns: Path) -> dict[str, InterfaceCounters]:
    with netns_entered(netns), open("/proc/thread-self/net/dev") as handle:
        return parse_net_dev(handle.read())
