"""Interface counters of a pod's network namespace (`/proc/net/dev` as the pod sees it).

`/proc/<pid>/net/dev` would need a live process in the pod, and a pod whose containers
have all exited still has a network. So a short-lived thread of its own enters each
pinned namespace in turn (setns affects only the calling thread), reads
`/proc/thread-self/net/dev`, and goes back. The thread is never reused: should the way
back fail, it ends in the pod's namespace and nothing else ever runs there. No process
is forked (which a gRPC daemon must avoid) and nothing is mounted.

One thread reads all the namespaces it is given (a stats call's batch of pods):
starting a thread costs ten times what entering a namespace and reading the file do
(about 400 and 30 µs of CPU here), and kubelet asks for every pod's network every ~10 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class NetnsCounters:
    """One namespace's interface counters (every interface but loopback), or why they
    could not be read."""

    read_at: int  # nanoseconds since the epoch
    interfaces: dict[str, InterfaceCounters] = field(default_factory=dict)
    error: OSError | TimeoutError | None = None


def read_netns_counters(namespaces: Sequence[Path]) -> list[NetnsCounters]:
    """The counters of each namespace pinned at `namespaces`, in their order, read by one
    thread of its own. Blocking (tens of microseconds each, and the thread's start):
    call it from a worker thread."""
    read: list[NetnsCounters] = []

    def work() -> None:
        for netns in namespaces:
            try:
                interfaces = _read_inside(netns)
            except OSError as exc:
                # Even a failed way back leaves the next namespace readable: each is
                # entered by its own file, and the thread ends after the last.
                read.append(NetnsCounters(time.time_ns(), error=exc))
            else:
                interfaces.pop("lo", None)
                read.append(NetnsCounters(time.time_ns(), interfaces))

    thread = threading.Thread(target=work, name="netdev-reader", daemon=True)
    thread.start()
    thread.join(READ_TIMEOUT + 0.01 * len(namespaces))
    done = list(read)  # the thread may still append after a timeout
    for netns in namespaces[len(done) :]:
        timeout = TimeoutError(f"reading interface counters of {netns} took too long")
        done.append(NetnsCounters(time.time_ns(), error=timeout))
    return done


def _read_inside(netns: Path) -> dict[str, InterfaceCounters]:
    with netns_entered(netns), open("/proc/thread-self/net/dev") as handle:
        return parse_net_dev(handle.read())
