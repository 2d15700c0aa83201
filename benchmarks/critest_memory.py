"""The daemon's memory after critest's benchmarks: the same client run against every CRI
runtime (containerd's RSS after it: 49 MiB on 2026-12-02), so the figure compares.

Usage: sudo flock /tmp/critest.lock .venv/bin/python benchmarks/critest_memory.py
                                             [--plain] [--kit DIR] [-- CRITEST-ARGS...]

The daemon runs as the installed unit runs it (`python -OO -X no_debug_ranges`, from
bytecode compiled so) unless --plain is given, with the conformance gate's set-up
(tests/conformance.py: the stand-in images served from a local registry, every registry
critest names mirrored to it, the runc handler). It prints the daemon's RSS, PSS and
anonymous memory idle, after `critest -benchmark` (pod sandbox, container and image
benchmarks with their default parameters), after the pods and containers it left are
removed, and --later seconds after that (past a heap trim). The figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import BYTECODE, compile_as_installed, run_critest_benchmark
from memory import Footprint

from tests.conformance import CACHE, DEFAULT_HANDLER, DEFAULT_KIT, critest_site, remove_leftovers
from tests.harness import INSTALLED_FLAGS, Daemon

SETTLE = 2.0  # seconds before a sample, for the loop to finish what a reply left


def report(label: str, pid: int) -> None:
    time.sleep(SETTLE)
    own = Footprint.of(pid)
    print(
        f"{label:<28} daemon RSS {own.rss:5.1f}  PSS {own.pss:5.1f}  USS {own.uss:5.1f}"
        f"  anonymous {own.anonymous:5.1f}  threads {own.threads:3d}",
        flush=True,
    )


def run_benchmarks(critest: Path, daemon: Daemon, work: Path, extra: list[str]) -> int:
    args = [f"-benchmarking-output-dir={work / 'results'}", *extra]
    log = CACHE / "critest-benchmark.log"
    return run_critest_benchmark(critest, f"unix://{daemon.socket}", work, log, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--kit", type=Path, default=DEFAULT_KIT, help="the conformance kit")
    parser.add_argument(
        "--plain",
        action="store_true",
        help="run the daemon with the interpreter's default options, not the installed unit's",
    )
    parser.add_argument("--later", type=float, default=35.0, help="seconds before the last sample")
    parser.add_argument("critest_args", nargs="*", help="more critest arguments, after --")
    args = parser.parse_args()
    critest = args.kit / "bin" / "critest"
    if not critest.exists():
        print(f"critest_memory: no critest at {critest}")
        return 2
    flags = [] if args.plain else INSTALLED_FLAGS
    if flags:
        compile_as_installed()
    with critest_site(args.kit, DEFAULT_HANDLER) as (work, network, settings):
        daemon = Daemon(work, network, settings=settings, env=BYTECODE, interpreter_flags=flags)
        daemon.start()
        try:
            assert daemon.proc is not None
            pid = daemon.proc.pid
            how = " ".join(flags) or "the interpreter's defaults"
            print(f"MiB, from /proc/PID/smaps_rollup; the daemon runs with {how}", flush=True)
            report("idle", pid)
            started = time.monotonic()
            code = run_benchmarks(critest, daemon, work, args.critest_args)
            report(f"after the benchmarks ({time.monotonic() - started:.0f} s)", pid)
            left = remove_leftovers(daemon)
            report(f"after removing {len(left)} left", pid)
            # The heap is trimmed every 30 s (host/heap.py): what stays after one trim.
            time.sleep(args.later)
            report(f"{args.later:.0f} s later", pid)
        finally:
            daemon.stop()
    if code != 0:
        print(f"critest exited with {code} (log: {CACHE / 'critest-benchmark.log'})")
    return code


if __name__ == "__main__":
    sys.exit(main())
