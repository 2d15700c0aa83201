"""What the socket-activation relay (cri_shim/transport/relay.py) adds to a call: the same
daemon measured binding its own socket and served through a socket passed as systemd
passes it (tests/harness.py `pass_fds`), one client calling serially.

Usage: sudo .venv/bin/python benchmarks/socket_relay.py [--calls 2000]

Per call (Version, ListPodSandbox with no pods): the median and the 99th percentile of
each, and the relay's difference. The figures are printed, never asserted.
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


def timings(daemon: Daemon, calls: int) -> dict[str, list[float]]:
    runtime = daemon.runtime()
    found: dict[str, list[float]] = {}
    for name, (method, request) in CALLS.items():
        call = getattr(runtime, method)
        for _ in range(calls // 10):  # warm-up
            call(request, timeout=10)
        found[name] = []
        for _ in range(calls):
            started = time.perf_counter()
            call(request, timeout=10)
            found[name].append(time.perf_counter() - started)
    return found


def measure(base: Path, activated: bool, calls: int) -> dict[str, list[float]]:
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
    try:
        return timings(daemon, calls)
    finally:
        daemon.stop()
        if held is not None:
            held.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cs-relay-", dir="/tmp") as tmp:
        direct = measure(Path(tmp) / "direct", False, args.calls)
        relayed = measure(Path(tmp) / "relayed", True, args.calls)
    print(f"{'call':16} {'own socket':>22} {'relayed':>22} {'median +':>10}")
    for name in CALLS:
        row = []
        for found in (direct, relayed):
            ordered = sorted(found[name])
            p99 = ordered[int(len(ordered) * 0.99) - 1]
            row.append(f"{statistics.median(ordered) * 1e6:8.0f} µs p99 {p99 * 1e6:6.0f} µs")
        delta = (statistics.median(relayed[name]) - statistics.median(direct[name])) * 1e6
        print(f"{name:16} {row[0]:>22} {row[1]:>22} {delta:+8.0f} µs")


if __name__ == "__main__":
    main()
