"""What the socket-activation relay (cri_shim/transport/relay.py) adds to a call: the same
daemon measured binding its own socket and served through a socket passed as systemd
passes it (tests/harness.py `pass_fds`), one client calling serially.

Usage: sudo .venv/bin/python benchmarks/socket_relay.py [--calls 2000]

Both daemons run at once and take turns in blocks of calls (--block), so that the load
the rest of the machine puts on them is the same for both. Per call (Version,
ListPodSandbox with no pods): the median and the 99th percentile of each, and the
relay's difference. The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon

CALLS = {
    "Version": ("Version", api_pb2.VersionRequest()),
    "ListPodSandbox": ("ListPodSandbox", api_pb2.ListPodSandboxRequest()),
}


def start(base: Path, activated: bool) -> tuple[Daemon, socket.socket | None]:
    (base / "run").mkdir(parents=True)
    held = None
    if activated:
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.bind(str(base / "run" / "cri-shim.sock"))
        held.listen(socket.SOMAXCONN)
    daemon = Daemon(
        base, None, settings={"log_level": "warning"}, pass_fds=(held.fileno(),) if held else ()
    )
    daemon.start()
    return daemon, held


def interleaved(
    daemons: dict[str, Daemon], calls: int, block: int
) -> dict[str, dict[str, list[float]]]:
    """Per mode and call, the time of each of `calls` calls, the modes taking turns in
    blocks of `block` calls so that both see the same load from the rest of the machine."""
    found: dict[str, dict[str, list[float]]] = {mode: {} for mode in daemons}
    for name, (method, request) in CALLS.items():
        stubs = {mode: getattr(daemon.runtime(), method) for mode, daemon in daemons.items()}
        for call in stubs.values():
            for _ in range(max(calls // 10, 1)):  # warm-up
                call(request, timeout=10)
        for mode in daemons:
            found[mode][name] = []
        for turn in range(0, calls, block):
            # Each round's first mode alternates: neither always follows the other.
            order = list(daemons) if (turn // block) % 2 == 0 else list(reversed(daemons))
            for mode in order:
                call, times = stubs[mode], found[mode][name]
                for _ in range(min(block, calls - turn)):
                    started = time.perf_counter()
                    call(request, timeout=10)
                    times.append(time.perf_counter() - started)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--block", type=int, default=100, help="calls per turn of a mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cs-relay-", dir="/tmp") as tmp:
        direct, _ = start(Path(tmp) / "direct", False)
        relayed, held = start(Path(tmp) / "relayed", True)
        try:
            found = interleaved({"own": direct, "relayed": relayed}, args.calls, args.block)
        finally:
            for daemon in (direct, relayed):
                daemon.stop()
            if held is not None:
                held.close()
    print(f"{'call':16} {'own socket':>22} {'relayed':>22} {'median +':>10}")
    for name in CALLS:
        row = []
        for mode in ("own", "relayed"):
            ordered = sorted(found[mode][name])
            p99 = ordered[int(len(ordered) * 0.99) - 1]
            row.append(f"{statistics.median(ordered) * 1e6:8.0f} µs p99 {p99 * 1e6:6.0f} µs")
        own, relayed_median = (statistics.median(found[mode][name]) for mode in ("own", "relayed"))
        delta = (relayed_median - own) * 1e6
        print(f"{name:16} {row[0]:>22} {row[1]:>22} {delta:+8.0f} µs")


if __name__ == "__main__":
    main()
