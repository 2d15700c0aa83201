"""The daemon's RSS: idle, with N pods held (one running container each), and across
many pod cycles (a leak test: RSS sampled every 100 cycles, after a warm-up).

Usage: sudo .venv/bin/python benchmarks/memory.py [--held 100] [--cycles 1000]

Each cycle is RunPodSandbox, CreateContainer, StartContainer, StopPodSandbox,
RemovePodSandbox, serially. The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import bench_daemon, pod_with_container, rss_mib, rss_split_mib

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, import_image
from tests.imagebuild import cached_oci_layout


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    rt = daemon.runtime()
    rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
    rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", type=int, default=100)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=30)
    args = parser.parse_args()
    with bench_daemon(slow_cni=False) as daemon, tempfile.TemporaryDirectory() as scratch:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        time.sleep(1.0)
        idle = rss_mib(pid)
        idle_anon, idle_file = rss_split_mib(pid)
        import_image(daemon, cached_oci_layout(Path(scratch)))
        held = [pod_with_container(daemon, f"held-{i}") for i in range(args.held)]
        with_held = rss_mib(pid)
        for sandbox_id in held:
            remove_pod(daemon, sandbox_id)
        after_held = rss_mib(pid)
        samples: list[tuple[int, float]] = []
        started = time.perf_counter()
        for cycle in range(1, args.warmup + args.cycles + 1):
            remove_pod(daemon, pod_with_container(daemon, f"cycle-{cycle}"))
            if cycle == args.warmup or (cycle > args.warmup and (cycle - args.warmup) % 100 == 0):
                samples.append((cycle - args.warmup, rss_mib(pid)))
        took = time.perf_counter() - started
        leaks = daemon.leaks()
    print(
        f"{'daemon RSS idle':<34} {idle:6.1f} MiB"
        f"   (anonymous {idle_anon:.1f}, shared-library pages {idle_file:.1f})"
    )
    print(f"{f'with {args.held} pods (1 container each)':<34} {with_held:6.1f} MiB")
    print(f"{'after removing them':<34} {after_held:6.1f} MiB")
    print(f"pod cycles (after {args.warmup} warm-up cycles), {took:.0f} s in all:")
    for cycle, rss in samples:
        print(f"  after {cycle:5d} cycles                {rss:6.1f} MiB")
    growth = samples[-1][1] - samples[0][1]
    per_100 = growth / max(1, samples[-1][0]) * 100
    print(f"{'growth over the cycles':<34} {growth:+6.1f} MiB ({per_100:+.2f} MiB per 100)")
    print(f"{'leaks after the cycles':<34} {leaks or 'none'}")


if __name__ == "__main__":
    main()
