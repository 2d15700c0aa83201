"""Read RPCs at parallelism 1 and 4, idle and beside a stream of creations.

Each client is a process of its own (a thread would share this interpreter with the
others and measure it), calling one RPC back to back; printed are the medians and p95s
per RPC, and the daemon's own report of its event loop (Status verbose `eventLoop`,
sampled every 5 ms): how long any request could have waited for it.

    .venv/bin/python benchmarks/reads.py [--calls 400] [--pods 30] [--rpcs Version ...]
        [--idle-only] [--metrics]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import threading
import time
from pathlib import Path

from common import bench_daemon, cpu_seconds, percentiles, pod_with_container

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from tests.harness import Daemon, import_image, pod_config
from tests.imagebuild import cached_oci_layout

SAMPLE_INTERVAL = "5ms"
# Version is the floor: gRPC's own cost of a call, with nothing to look up.
RPCS = ("Version", "ContainerStatus", "PodSandboxStatus", "Status", "ListContainers")


def _client(socket: str, rpc: str, ids: list[str], calls: int) -> list[float]:
    import grpc

    channel = grpc.insecure_channel(f"unix://{socket}")
    runtime = api_pb2_grpc.RuntimeServiceStub(channel)  # type: ignore[no-untyped-call]
    make = {
        "ContainerStatus": lambda i: (
            runtime.ContainerStatus,
            api_pb2.ContainerStatusRequest(container_id=ids[i % len(ids)]),
        ),
        "PodSandboxStatus": lambda i: (
            runtime.PodSandboxStatus,
            api_pb2.PodSandboxStatusRequest(pod_sandbox_id=ids[i % len(ids)]),
        ),
        "Status": lambda i: (runtime.Status, api_pb2.StatusRequest()),
        "Version": lambda i: (runtime.Version, api_pb2.VersionRequest()),
        "ListContainers": lambda i: (runtime.ListContainers, api_pb2.ListContainersRequest()),
        "ListPodSandbox": lambda i: (runtime.ListPodSandbox, api_pb2.ListPodSandboxRequest()),
    }[rpc]
    for i in range(20):  # warm the channel
        call, request = make(i)
        call(request, timeout=30)
    latencies = []
    for i in range(calls):
        call, request = make(i)
        started = time.perf_counter()
        call(request, timeout=30)
        latencies.append(time.perf_counter() - started)
    channel.close()
    return latencies


def measure(
    daemon: Daemon, rpc: str, ids: list[str], parallel: int, calls: int
) -> tuple[list[float], float]:
    """The latencies of `parallel` clients making `calls` calls each, and the daemon's
    CPU time per call (all its threads), which the clients' own load does not blur."""
    assert daemon.proc is not None
    context = multiprocessing.get_context("spawn")
    with context.Pool(parallel) as pool:
        pool.map(abs, range(parallel))  # the workers started before the clock does
        cpu = cpu_seconds(daemon.proc.pid)
        results = pool.starmap(_client, [(str(daemon.socket), rpc, ids, calls)] * parallel)
        cpu = cpu_seconds(daemon.proc.pid) - cpu
    # Each client's 20 warm-up calls are counted in the CPU time too.
    return [latency for result in results for latency in result], cpu / ((calls + 20) * parallel)


def churn(daemon: Daemon, stop: threading.Event, made: list[str]) -> None:
    """Pods created and removed one after another until `stop`: the writes beside."""
    runtime = daemon.runtime()
    index = 0
    while not stop.is_set():
        name = f"churn-{index}"
        index += 1
        config = pod_config(name, uid=name)
        sandbox_id = runtime.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=config), timeout=60
        ).pod_sandbox_id
        runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60
        )
        made.append(sandbox_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=400, help="calls per client")
    parser.add_argument("--pods", type=int, default=30)
    parser.add_argument("--rpcs", nargs="+", default=RPCS, choices=RPCS, metavar="RPC")
    parser.add_argument("--idle-only", action="store_true", help="no creations beside")
    parser.add_argument("--metrics", action="store_true", help="serve [metrics] listen")
    args = parser.parse_args()
    settings = {"metrics": {"event_loop_sample_interval": SAMPLE_INTERVAL}}
    if args.metrics:
        settings["metrics"]["listen"] = "127.0.0.1:0"
    with bench_daemon(settings, slow_cni=False) as daemon, tempfile.TemporaryDirectory() as scratch:
        import_image(daemon, cached_oci_layout(Path(scratch)))
        sandboxes = [pod_with_container(daemon, f"read-{i}") for i in range(args.pods)]
        runtime = daemon.runtime()
        containers = [
            c.id
            for c in runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=30).containers
        ]
        ids = {"ContainerStatus": containers, "PodSandboxStatus": sandboxes}
        print(f"{args.pods} pods with a running container each; {args.calls} calls per client")
        print(
            f"{'rpc':<18} {'beside':<10} {'p1 median':>10} {'p95':>7} {'p4 median':>10} "
            f"{'p95':>7}  ms   daemon CPU per call, us (p1, p4)"
        )
        for beside in ("idle",) if args.idle_only else ("idle", "creations"):
            stop = threading.Event()
            made: list[str] = []
            writer = threading.Thread(target=churn, args=(daemon, stop, made))
            before = daemon.status_info()["eventLoop"]
            if beside == "creations":
                writer.start()
            for rpc in args.rpcs:
                cells = []
                costs = []
                for parallel in (1, 4):
                    latencies, cpu = measure(daemon, rpc, ids.get(rpc, [""]), parallel, args.calls)
                    median, p95 = percentiles(latencies)
                    cells.append(f"{median * 1000:10.2f} {p95 * 1000:7.2f}")
                    costs.append(f"{cpu * 1e6:5.0f}")
                note = "" if beside == "idle" else " (with the creations')"
                print(f"{rpc:<18} {beside:<10} {' '.join(cells)}      {', '.join(costs)}{note}")
            stop.set()
            if beside == "creations":
                writer.join()
            after = daemon.status_info()["eventLoop"]
            over = {
                bound: after["stallsOverMs"][bound] - before["stallsOverMs"][bound]
                for bound in after["stallsOverMs"]
            }
            print(
                f"  event loop ({beside}): {after['samples'] - before['samples']} samples, "
                f"stalls over 1/10/100 ms: {over['1']}/{over['10']}/{over['100']}, "
                f"longest since start {after['longestStallMs']:.1f} ms"
                + (f"; {len(made)} pods created and removed beside" if made else "")
            )


if __name__ == "__main__":
    main()
