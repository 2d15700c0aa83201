"""What kubelet's stats calls cost the daemon: ListPodSandboxStats and ListContainerStats
over N pods, each with a network and one running container.

kubelet's summary API and eviction manager call both every ~10 s, one after the other;
printed is the daemon's CPU time per call (all its threads, from the scheduler) for each
alone and for the pair as kubelet makes it, and the client's latency. The figures are
printed, never asserted.

    .venv/bin/python benchmarks/stats.py [--pods 50] [--rounds 20] [--layer-max-age 0]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import bench_daemon, cpu_seconds, percentiles, pod_with_container

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, import_image
from tests.imagebuild import cached_oci_layout


def measure(daemon: Daemon, call: Callable[[], object], rounds: int, pause: float) -> str:
    assert daemon.proc is not None
    latencies = []
    cpu = 0.0
    for _ in range(rounds):
        time.sleep(pause)  # apart, as kubelet's are: nothing of one call is cached for the next
        before = cpu_seconds(daemon.proc.pid)
        started = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - started)
        cpu += cpu_seconds(daemon.proc.pid) - before
    median, p95 = percentiles(latencies)
    return (
        f"CPU {cpu / rounds * 1000:7.1f} ms per call   latency median {median * 1000:6.1f} ms"
        f"  p95 {p95 * 1000:6.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between calls (kubelet: 10)"
    )
    parser.add_argument(
        "--layer-max-age", help="[metrics] layer_usage_max_age (0: walk at every call)"
    )
    args = parser.parse_args()
    settings: dict[str, object] = {"log_level": "info"}
    if args.layer_max_age is not None:
        settings["metrics"] = {"layer_usage_max_age": args.layer_max_age}
    with (
        bench_daemon(settings, slow_cni=False) as daemon,
        tempfile.TemporaryDirectory() as scratch,
    ):
        import_image(daemon, cached_oci_layout(Path(scratch)))
        for i in range(args.pods):
            pod_with_container(daemon, f"stats-{i}")
        runtime = daemon.runtime()

        def pods() -> None:
            runtime.ListPodSandboxStats(api_pb2.ListPodSandboxStatsRequest(), timeout=60)

        def containers() -> None:
            runtime.ListContainerStats(api_pb2.ListContainerStatsRequest(), timeout=60)

        def both() -> None:
            pods()
            containers()

        pods()  # the first samples of CPU rates
        print(f"{args.pods} pods with a running container each; {args.rounds} rounds")
        for name, call in (
            ("ListPodSandboxStats", pods),
            ("ListContainerStats", containers),
            ("both, as kubelet", both),
        ):
            print(f"{name:<20} {measure(daemon, call, args.rounds, args.pause)}")


if __name__ == "__main__":
    main()
