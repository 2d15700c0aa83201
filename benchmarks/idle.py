"""The idle daemon's cost: no pods, no client, for a minute.

Printed are its CPU time (all threads, the scheduler's) as a share of one core, and how
often its threads woke (context switches, from /proc/PID/task/*/status) and their CPU
time, per thread name: every timer an idle daemon runs shows up here. Run it with
`--metrics` to serve `[metrics] listen` as well.

    .venv/bin/python benchmarks/idle.py [--seconds 60] [--metrics] [--settle 5]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from common import bench_daemon, cpu_seconds, thread_cpu_seconds


def per_thread(pid: int) -> tuple[Counter[str], Counter[str]]:
    """Context switches and CPU seconds so far, by thread name."""
    counts: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended while we looked
        seconds = thread_cpu_seconds(task)
        if seconds is None:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        switches = int(fields["voluntary_ctxt_switches"]) + int(
            fields["nonvoluntary_ctxt_switches"]
        )
        name = fields["Name"].strip()
        counts[name] += switches
        cpu[name] += seconds
    return counts, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=5.0, help="wait after the start")
    parser.add_argument("--metrics", action="store_true", help="serve [metrics] listen")
    args = parser.parse_args()
    # The embedded defaults but for the roots: info logging, the loop monitor on.
    settings: dict[str, object] = {"log_level": "info"}
    if args.metrics:
        settings["metrics"] = {"listen": "127.0.0.1:0"}
    with bench_daemon(settings, slow_cni=False) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        time.sleep(args.settle)
        cpu, (woke, threads), started = cpu_seconds(pid), per_thread(pid), time.monotonic()
        time.sleep(args.seconds)
        cpu = cpu_seconds(pid) - cpu
        elapsed = time.monotonic() - started
        woke_after, threads_after = per_thread(pid)
        woke, threads = woke_after - woke, threads_after - threads
    print(
        f"idle {elapsed:.0f} s: {cpu * 1000:.1f} ms CPU, {100 * cpu / elapsed:.3f} % of a core; "
        f"{sum(woke.values()) / elapsed:.1f} wakeups/s"
    )
    for name, count in woke.most_common():
        if count:
            print(
                f"  {name:<20} {count / elapsed:7.1f} wakeups/s "
                f"{100 * threads[name] / elapsed:7.3f} % of a core"
            )


if __name__ == "__main__":
    main()
