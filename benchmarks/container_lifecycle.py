"""CreateContainer / StartContainer / StopContainer / RemoveContainer latency, and RSS.

Usage: sudo .venv/bin/python benchmarks/container_lifecycle.py [--containers 50] [--userns]

--userns runs them in a pod with a user namespace of its own (idmapped mounts).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import bench_daemon, row, rss_mib

from cri_shim.api.v1 import api_pb2
from tests.harness import import_image, pod_config, userns_linux
from tests.imagebuild import cached_oci_layout

IMAGE = "docker.io/library/busybox:latest"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--containers", type=int, default=50)
    parser.add_argument("--userns", action="store_true", help="a pod with its own user namespace")
    args = parser.parse_args()
    create, start, stop, remove = [], [], [], []
    with bench_daemon(slow_cni=False) as daemon, tempfile.TemporaryDirectory() as scratch:
        layout = cached_oci_layout(Path(scratch))
        import_image(daemon, layout)
        rt = daemon.runtime()
        config = pod_config("bench", **({"linux": userns_linux(65536 * 99)} if args.userns else {}))
        sandbox_id = rt.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config), timeout=60
        ).pod_sandbox_id
        ids = []
        for i in range(args.containers):
            cfg = api_pb2.ContainerConfig(
                metadata=api_pb2.ContainerMetadata(name=f"c{i}"),
                image=api_pb2.ImageSpec(image=IMAGE),
                # A shell that honours SIGTERM (PID 1 ignores signals it has no handler for).
                command=["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
            )
            t0 = time.perf_counter()
            cid = rt.CreateContainer(
                api_pb2.CreateContainerRequest(
                    pod_sandbox_id=sandbox_id, config=cfg, sandbox_config=config
                ),
                timeout=60,
            ).container_id
            t1 = time.perf_counter()
            rt.StartContainer(api_pb2.StartContainerRequest(container_id=cid), timeout=60)
            t2 = time.perf_counter()
            create.append(t1 - t0)
            start.append(t2 - t1)
            ids.append(cid)
        assert daemon.proc is not None
        rss_running = rss_mib(daemon.proc.pid)
        for cid in ids:
            t0 = time.perf_counter()
            rt.StopContainer(api_pb2.StopContainerRequest(container_id=cid, timeout=10), timeout=60)
            t1 = time.perf_counter()
            rt.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=cid), timeout=60)
            t2 = time.perf_counter()
            stop.append(t1 - t0)
            remove.append(t2 - t1)
        rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        leaks = daemon.leaks()
    print(row("CreateContainer", create))
    print(row("StartContainer", start))
    print(row("StopContainer", stop))
    print(row("RemoveContainer", remove))
    print(f"{'daemon RSS':<22} with {args.containers} running containers {rss_running:.1f} MiB")
    print(f"{'leaks after removal':<22} {leaks or 'none'}")


if __name__ == "__main__":
    main()
