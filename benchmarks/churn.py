"""Churn figures (pods/s, pod-to-running, peak RSS) and start-to-serving time of a full node.

Usage: sudo .venv/bin/python benchmarks/churn.py [--pods 200] [--parallel 8] [--restore 100]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import bench_daemon, percentiles, pod_with_container

from cri_shim.api.v1 import api_pb2
from tests.churn import Churn
from tests.harness import Daemon, import_image
from tests.imagebuild import cached_oci_layout


def restore_time(daemon: Daemon, count: int) -> float:
    sandboxes = [pod_with_container(daemon, f"full-{i}") for i in range(count)]
    daemon.stop()
    t0 = time.perf_counter()
    daemon.start()
    took = time.perf_counter() - t0
    listed = daemon.runtime().ListContainers(api_pb2.ListContainersRequest(), timeout=30).containers
    assert len(listed) == count, len(listed)
    for sid in sandboxes:
        daemon.runtime().RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60
        )
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--restore", type=int, default=100)
    args = parser.parse_args()
    with bench_daemon(slow_cni=False) as daemon, tempfile.TemporaryDirectory() as scratch:
        import_image(daemon, cached_oci_layout(Path(scratch)))
        report = Churn(daemon).run(pods=args.pods, parallel=args.parallel)
        p50, p95 = percentiles(report.pod_to_running)
        leaks = daemon.leaks()
        restore = restore_time(daemon, args.restore)
    print(f"churn: {args.pods} pods, {args.parallel} at a time, containers living 2 s")
    print(f"  pods per second        {report.pods_per_second:.2f}")
    print(f"  pod-to-running         p50 {p50 * 1000:.0f} ms   p95 {p95 * 1000:.0f} ms")
    print(f"  daemon peak RSS        {report.peak_rss_mib:.1f} MiB")
    print(f"  errors / conflicts     {len(report.errors)} / {len(report.conflicts)}")
    print(f"  leaks after churn      {leaks or 'none'}")
    print(
        f"restore: start to serving with {args.restore} sandboxes + {args.restore} containers: "
        f"{restore:.2f} s"
    )


if __name__ == "__main__":
    main()
