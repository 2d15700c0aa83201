"""RunPodSandbox / StopPodSandbox / RemovePodSandbox latency and the daemon's RSS.

Usage: sudo .venv/bin/python benchmarks/sandbox_lifecycle.py [--cycles 50] [--userns]

--userns gives every pod a user namespace of its own (hostUsers: false).
"""

from __future__ import annotations

import argparse
import time

from common import bench_daemon, row, rss_mib

from cri_shim.api.v1 import api_pb2
from tests.harness import pod_config, userns_linux


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--userns", action="store_true", help="pods with their own user namespace")
    args = parser.parse_args()

    def config(name: str, index: int) -> api_pb2.PodSandboxConfig:
        extra = {"linux": userns_linux(65536 * (100 + index))} if args.userns else {}
        return pod_config(name, uid=name, **extra)

    run, stop, remove = [], [], []
    with bench_daemon(slow_cni=False) as daemon:
        rt = daemon.runtime()
        assert daemon.proc is not None
        time.sleep(1)
        idle = rss_mib(daemon.proc.pid)
        for i in range(args.cycles):
            t0 = time.perf_counter()
            sid = rt.RunPodSandbox(
                api_pb2.RunPodSandboxRequest(config=config(f"b{i}", i)), timeout=60
            ).pod_sandbox_id
            t1 = time.perf_counter()
            rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
            t2 = time.perf_counter()
            rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
            t3 = time.perf_counter()
            run.append(t1 - t0)
            stop.append(t2 - t1)
            remove.append(t3 - t2)
        ids = [
            rt.RunPodSandbox(
                api_pb2.RunPodSandboxRequest(config=config(f"h{i}", i)), timeout=60
            ).pod_sandbox_id
            for i in range(50)
        ]
        with_50 = rss_mib(daemon.proc.pid)
        for sid in ids:
            rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
        leaks = daemon.leaks()
    print(row("RunPodSandbox", run))
    print(row("StopPodSandbox", stop))
    print(row("RemovePodSandbox", remove))
    print(f"{'daemon RSS':<22} idle {idle:.1f} MiB   with 50 pods {with_50:.1f} MiB")
    print(f"{'leaks after removal':<22} {leaks or 'none'}")


if __name__ == "__main__":
    main()
