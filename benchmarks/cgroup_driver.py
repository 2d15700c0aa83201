"""A pod's start and removal under each cgroup driver (cgroupfs, systemd), on a host that
systemd runs with cgroup v2 (the QEMU guest lane: scripts/guest). Pods use the host's
network, so that the figures are the runtime's and the cgroup driver's, not CNI's.

Usage: sudo .venv/bin/python benchmarks/cgroup_driver.py [--pods 3]

Per driver: the median and the largest time from RunPodSandbox to StartContainer's
answer, and of StopPodSandbox + RemovePodSandbox, serially, after one warm-up pod. With
systemd each container gets runc's scope and its conmon a transient scope (one D-Bus call
each way). The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import sleeping_container

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, import_image, pod_config
from tests.imagebuild import cached_oci_layout

PARENTS = {
    "cgroupfs": "/kubepods/besteffort/pod{uid}",
    "systemd": "kubepods-besteffort-pod{uid}.slice",
}


def cycle(daemon: Daemon, driver: str, name: str) -> tuple[float, float]:
    rt = daemon.runtime()
    linux = api_pb2.LinuxPodSandboxConfig(
        cgroup_parent=PARENTS[driver].format(uid=name),
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(network=api_pb2.NODE)
        ),
    )
    config = pod_config(name, uid=name, linux=linux)
    t0 = time.perf_counter()
    sandbox_id = rt.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=240)
    container_id = rt.CreateContainer(
        api_pb2.CreateContainerRequest(
            pod_sandbox_id=sandbox_id.pod_sandbox_id,
            sandbox_config=config,
            config=sleeping_container(),
        ),
        timeout=240,
    ).container_id
    rt.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=240)
    t1 = time.perf_counter()
    rt.StopPodSandbox(
        api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id.pod_sandbox_id), timeout=240
    )
    rt.RemovePodSandbox(
        api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id.pod_sandbox_id), timeout=240
    )
    return t1 - t0, time.perf_counter() - t1


def run(driver: str, pods: int, layout: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="csd-", dir="/tmp"))
    daemon = Daemon(base, None, settings={"cgroup_manager": driver})
    daemon.start(timeout=300)
    try:
        import_image(daemon, layout)
        cycle(daemon, driver, f"warm{driver[0]}")
        figures = [cycle(daemon, driver, f"p{driver[0]}{i}") for i in range(pods)]
    finally:
        daemon.stop()
    for slice_unit in ("kubepods-besteffort.slice", "kubepods.slice"):
        subprocess.run(["systemctl", "stop", slice_unit], check=False, capture_output=True)
    starts, removals = [f[0] for f in figures], [f[1] for f in figures]
    print(
        f"{driver:9} start median {statistics.median(starts):.2f}s max {max(starts):.2f}s; "
        f"removal median {statistics.median(removals):.2f}s max {max(removals):.2f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=3)
    args = parser.parse_args()
    layout = cached_oci_layout(Path(tempfile.gettempdir()) / "cri-shim-bench-images")
    for driver in ("cgroupfs", "systemd"):
        run(driver, args.pods, layout)


if __name__ == "__main__":
    main()
