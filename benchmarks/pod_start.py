"""N pods arriving at once, as kubelet starts them on a node that has just been given them:
each pod's RunPodSandbox, PodSandboxStatus, CreateContainer, StartContainer and
ContainerStatus, all pods in parallel. Reports each call's latency, a pod's start (its
RunPodSandbox to its StartContainer's answer), and the runtime's CPU per pod start: the
daemon's own, the children it reaped (runc, CNI plugins), and the rest of its cgroup
(conmon and the `runc create` it runs).

Usage: sudo .venv/bin/python benchmarks/pod_start.py [--pods 50] [--runs 3] [--profile DIR]

--profile records the daemon with py-spy (raw collapsed stacks with the C frames) during
each run's starts, into DIR/run-N.txt; py-spy pauses the daemon at each sample then, so
the latencies of a profiled run are not comparable with those of another.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import bench_daemon, percentiles, sleeping_container
from runtime_cost import CpuAccount, Profiler, process_cpu_seconds

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, import_image, pod_config
from tests.imagebuild import cached_oci_layout

CALLS = ("RunPodSandbox", "CreateContainer", "StartContainer", "pod start")


def start_pod(daemon: Daemon, run: int, index: int, logs: Path) -> dict[str, float]:
    """One pod as kubelet's pod worker starts it; the seconds each call took."""
    rt = daemon.runtime()
    name = f"p{run}-{index}"
    config = pod_config(name, uid=name, log_directory=str(logs / name))
    t0 = time.perf_counter()
    sandbox_id = rt.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=config), timeout=240
    ).pod_sandbox_id
    t1 = time.perf_counter()
    rt.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id), timeout=60)
    t2 = time.perf_counter()
    container_id = rt.CreateContainer(
        api_pb2.CreateContainerRequest(
            pod_sandbox_id=sandbox_id,
            sandbox_config=config,
            config=sleeping_container(log_path="c/0.log"),
        ),
        timeout=240,
    ).container_id
    t3 = time.perf_counter()
    rt.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=240)
    t4 = time.perf_counter()
    rt.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id), timeout=60)
    return {
        "RunPodSandbox": t1 - t0,
        "CreateContainer": t3 - t2,
        "StartContainer": t4 - t3,
        "pod start": t4 - t0,
    }


def remove_all(daemon: Daemon) -> None:
    rt = daemon.runtime()
    listed = rt.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=60).items

    def remove(sandbox_id: str) -> None:
        request = api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id)
        rt.RemovePodSandbox(request, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(remove, [s.id for s in listed]))


def measure(
    daemon: Daemon, pid: int, cpu: CpuAccount, run: int, args: argparse.Namespace, logs: Path
) -> None:
    profiler = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        profiler = Profiler(pid, args.profile / f"run-{run}.txt", native=True, rate=200)
        time.sleep(1)  # attached
    own0, reaped0 = process_cpu_seconds(pid)
    total0 = cpu.seconds()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.pods) as pool:
        results = list(pool.map(lambda i: start_pod(daemon, run, i, logs), range(args.pods)))
    wall = time.perf_counter() - t0
    own1, reaped1 = process_cpu_seconds(pid)
    total = cpu.seconds() - total0
    if profiler is not None:
        profiler.finish()
    own, reaped, n = own1 - own0, reaped1 - reaped0, args.pods
    print(
        f"run {run}: {n} pods in {wall:.1f} s; CPU per pod: runtime {total / n * 1000:.0f} ms, "
        f"daemon {own / n * 1000:.0f} ms, reaped {reaped / n * 1000:.0f} ms, "
        f"rest (conmon, runc create) {(total - own - reaped) / n * 1000:.0f} ms"
    )
    for call in CALLS:
        samples = [r[call] for r in results]
        p50, p99 = percentiles(samples, 0.99)
        mean = sum(samples) / len(samples)
        print(
            f"  {call:<16} mean {mean * 1000:6.0f} ms  p50 {p50 * 1000:6.0f} ms  "
            f"p99 {p99 * 1000:6.0f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args()
    cpu = CpuAccount(f"crishim-podstart-{os.getpid()}")
    try:
        with (
            bench_daemon({"log_level": "info"}, slow_cni=False) as daemon,
            tempfile.TemporaryDirectory() as scratch,
        ):
            import_image(daemon, cached_oci_layout(Path(scratch)))
            assert daemon.proc is not None
            pid = daemon.proc.pid
            cpu.add(pid)
            for run in range(args.runs):
                measure(daemon, pid, cpu, run, args, Path(scratch) / "logs")
                remove_all(daemon)
            leaks = daemon.leaks()
        print(f"leaks after removal: {leaks or 'none'}")
    finally:
        cpu.remove()


if __name__ == "__main__":
    main()
