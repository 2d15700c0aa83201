"""How the list RPCs grow with the objects held: ListContainers (no filter, a label, a
pod, a state), ListPodSandbox and ListContainerStats at 100, 300 and 1,000 containers
(10 per pod, every other one running).

Usage: sudo .venv/bin/python benchmarks/listing.py [--steps 100,300,1000] [--per-pod 10]
                                                   [--start-every 2] [--samples 40]

Each list is called `--samples` times in a row at each step (ListContainerStats, which
reads every container's cgroup and walks its writable layer, a quarter as often). The
latency is the client's (this Python process decodes the reply too); the cost per object
is the daemon's CPU time per call (all its threads, from the scheduler) over the objects
it holds (containers, or sandboxes for ListPodSandbox), since a filter that scans pays for
all of them. CPU time, unlike latency, does not grow with what else the machine runs. The
last line says whether the cost per object stays flat, as it does when a list grows
linearly. The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common import bench_daemon, cpu_seconds, percentiles

from cri_shim.api.v1 import api_pb2
from tests.churn import IMAGE
from tests.harness import Daemon, import_image, pod_config
from tests.imagebuild import cached_oci_layout

# A list whose cost per object at the largest step is within this factor of the
# smallest step's is called linear (the fixed cost of a call only makes it smaller).
LINEAR_FACTOR = 1.3


@dataclass
class Pod:
    sandbox_id: str
    containers: list[str]


@dataclass
class Measured:
    rpc: str
    containers: int
    pods: int
    items: int
    median: float
    p90: float
    cpu: float  # the daemon's CPU seconds per call
    per_object_us: float


def make_pod(daemon: Daemon, index: int, per_pod: int, start_every: int) -> Pod:
    """A pod of `per_pod` sleeping containers, every `start_every`-th one started."""
    rt = daemon.runtime()
    name = f"list-{index}"
    config = pod_config(name, uid=name, labels={"app": name, "bench": "listing"})
    sandbox_id = rt.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=config), timeout=60
    ).pod_sandbox_id
    containers = []
    for slot in range(per_pod):
        container_id = rt.CreateContainer(
            api_pb2.CreateContainerRequest(
                pod_sandbox_id=sandbox_id,
                sandbox_config=config,
                config=api_pb2.ContainerConfig(
                    metadata=api_pb2.ContainerMetadata(name=f"c{slot}"),
                    image=api_pb2.ImageSpec(image=IMAGE),
                    command=["sleep", "3600"],
                    labels={"app": name, "slot": str(slot)},
                ),
            ),
            timeout=60,
        ).container_id
        if start_every and slot % start_every == 0:
            rt.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=60)
        containers.append(container_id)
    return Pod(sandbox_id, containers)


def list_calls(daemon: Daemon, pods: list[Pod]) -> dict[str, tuple[Callable[[], int], bool]]:
    """Each measured list: a call that answers the number of items, and whether its cost
    is counted per sandbox (else per container)."""
    rt = daemon.runtime()
    first_pod = pods[0].sandbox_id

    def containers(f: api_pb2.ContainerFilter | None = None) -> Callable[[], int]:
        request = api_pb2.ListContainersRequest(filter=f)
        return lambda: len(rt.ListContainers(request, timeout=60).containers)

    def sandboxes() -> int:
        return len(rt.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=60).items)

    def stats() -> int:
        request = api_pb2.ListContainerStatsRequest()
        return len(rt.ListContainerStats(request, timeout=60).stats)

    running = api_pb2.ContainerStateValue(state=api_pb2.CONTAINER_RUNNING)
    return {
        "ListContainers": (containers(), False),
        "  label slot=0": (
            containers(api_pb2.ContainerFilter(label_selector={"slot": "0"})),
            False,
        ),
        "  pod_sandbox_id": (containers(api_pb2.ContainerFilter(pod_sandbox_id=first_pod)), False),
        "  state RUNNING": (containers(api_pb2.ContainerFilter(state=running)), False),
        "ListPodSandbox": (sandboxes, True),
        "ListContainerStats": (stats, False),
    }


def measure(daemon: Daemon, pods: list[Pod], samples: int) -> list[Measured]:
    assert daemon.proc is not None
    held = sum(len(p.containers) for p in pods)
    measured = []
    for rpc, (call, per_sandbox) in list_calls(daemon, pods).items():
        times = []
        items = call()  # a warm-up, and the count
        cpu_before = cpu_seconds(daemon.proc.pid)
        for _ in range(samples // 4 if rpc == "ListContainerStats" else samples):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        cpu = (cpu_seconds(daemon.proc.pid) - cpu_before) / len(times)
        median, p90 = percentiles(times, high=0.9)
        objects = len(pods) if per_sandbox else held
        measured.append(
            Measured(rpc, held, len(pods), items, median, p90, cpu, cpu / objects * 1e6)
        )
    return measured


def remove_all(daemon: Daemon, pods: list[Pod], parallel: int) -> None:
    rt = daemon.runtime()

    def remove(pod: Pod) -> None:
        rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=120)
        rt.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=120
        )

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(remove, pods))


def verdict(results: list[Measured]) -> str:
    """Whether each list's cost per object stays flat from the smallest step to the largest."""
    worse = []
    for rpc in dict.fromkeys(r.rpc for r in results):
        rows = [r for r in results if r.rpc == rpc]
        if rows[-1].per_object_us > LINEAR_FACTOR * rows[0].per_object_us:
            ratio = rows[-1].per_object_us / rows[0].per_object_us
            worse.append(f"{rpc.strip()} ({ratio:.2f}x)")
    first, last = results[0].containers, results[-1].containers
    if worse:
        return f"growth per item is NOT flat from {first} to {last} containers: {', '.join(worse)}"
    return (
        f"growth per item stays flat (linear) from {first} to {last} containers: every list's "
        f"cost per object at {last} is within {LINEAR_FACTOR}x of that at {first}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", default="100,300,1000", help="containers held at each step")
    parser.add_argument("--per-pod", type=int, default=10)
    parser.add_argument("--start-every", type=int, default=2, help="0 leaves them all created")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--parallel", type=int, default=8)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    results: list[Measured] = []
    pods: list[Pod] = []
    with bench_daemon(slow_cni=False) as daemon, tempfile.TemporaryDirectory() as scratch:
        import_image(daemon, cached_oci_layout(Path(scratch)))
        try:
            with ThreadPoolExecutor(args.parallel) as pool:
                for step in steps:
                    wanted = range(len(pods), -(-step // args.per_pod))
                    t0 = time.perf_counter()
                    pods += pool.map(
                        lambda i: make_pod(daemon, i, args.per_pod, args.start_every), wanted
                    )
                    took = time.perf_counter() - t0
                    held = sum(len(p.containers) for p in pods)
                    print(f"  {held} containers in {len(pods)} pods ({took:.0f} s to add)")
                    results += measure(daemon, pods, args.samples)
        finally:
            remove_all(daemon, pods, args.parallel)
        leaks = daemon.leaks()
    running = f"1 in {args.start_every} running" if args.start_every else "none running"
    print(
        f"lists with {args.per_pod} containers per pod, {running}: the client's latency, "
        "the daemon's CPU time per call and per object held"
    )
    print(
        f"{'containers':>10} {'pods':>5}  {'rpc':<20} {'items':>6} {'median ms':>10} "
        f"{'p90 ms':>8} {'cpu ms':>8} {'cpu us/object':>14}"
    )
    for r in results:
        print(
            f"{r.containers:>10} {r.pods:>5}  {r.rpc:<20} {r.items:>6} {r.median * 1000:>10.2f} "
            f"{r.p90 * 1000:>8.2f} {r.cpu * 1000:>8.2f} {r.per_object_us:>14.1f}"
        )
    print(f"{'leaks after removal':<22} {leaks or 'none'}")
    print(verdict(results))


if __name__ == "__main__":
    main()
