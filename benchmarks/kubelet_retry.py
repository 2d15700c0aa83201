"""kubelet's retry pattern with time scaled down, with and without keep_on_timeout.

kubelet gives RunPodSandbox a deadline D (2 minutes by default) and retries the same pod
about 10-15 s after a failure. Here D is scaled down (default 1 s), the retry gap with
it, and the CNI plugin takes 1.5 x D. For each mode, 20 pods run concurrently; each pod
retries until it is ready or a budget of requests is spent.

Usage: sudo .venv/bin/python benchmarks/kubelet_retry.py [--deadline 1.0] [--pods 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass

import grpc
from common import bench_daemon
from cri_api.v1 import api_pb2

from tests.harness import Daemon, pod_config, wait_until

# kubelet: 2 min deadline, retry after 10-15 s.
RETRY_GAP = (10 / 120, 15 / 120)


@dataclass
class PodOutcome:
    requests: int = 0
    ready_after: float | None = None
    sandbox_id: str = ""


def drive_pod(
    daemon: Daemon, index: int, deadline: float, max_requests: int, out: PodOutcome
) -> None:
    rt = daemon.runtime()
    started = time.monotonic()
    for _ in range(max_requests):
        out.requests += 1
        try:
            out.sandbox_id = rt.RunPodSandbox(
                api_pb2.RunPodSandboxRequest(config=pod_config(f"p{index}", uid=f"u{index}")),
                timeout=deadline,
            ).pod_sandbox_id
            out.ready_after = time.monotonic() - started
            return
        except grpc.RpcError:
            time.sleep(random.uniform(*RETRY_GAP) * deadline)


def run_mode(keep: bool, deadline: float, pods: int, max_requests: int) -> dict[str, object]:
    settings = {
        "creation": {"keep_on_timeout": keep, "claim_grace": f"{int(max(2, deadline * 3))}s"}
    }
    with bench_daemon(settings) as daemon:
        assert daemon.network is not None
        daemon.network.delay_file.write_text(str(1.5 * deadline))
        outcomes = [PodOutcome() for _ in range(pods)]
        threads = [
            threading.Thread(
                target=drive_pod, args=(daemon, i, deadline, max_requests, outcomes[i])
            )
            for i in range(pods)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        adds = daemon.network.adds()
        for o in outcomes:
            if o.sandbox_id:
                daemon.runtime().RemovePodSandbox(
                    api_pb2.RemovePodSandboxRequest(pod_sandbox_id=o.sandbox_id), timeout=60
                )
        try:
            wait_until(lambda: daemon.leaks() == {}, timeout=30 + deadline * 10, interval=0.5)
            leaks = 0
        except TimeoutError:
            leaks = sum(len(v) for v in daemon.leaks().values())
    ready = [o for o in outcomes if o.ready_after is not None]
    return {
        "mode": "keep_on_timeout=true" if keep else "keep_on_timeout=false",
        "ready": f"{len(ready)}/{pods}",
        "requests until ready (median)": statistics.median(o.requests for o in ready)
        if ready
        else "never",
        "time until ready (median, s)": round(statistics.median(o.ready_after for o in ready), 2)
        if ready
        else "never",
        "CNI ADDs per pod": round(adds / pods, 2),
        "leaked objects": leaks,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--max-requests", type=int, default=8)
    args = parser.parse_args()
    results = [
        run_mode(keep, args.deadline, args.pods, args.max_requests) for keep in (True, False)
    ]
    keys = list(results[0])
    width = max(len(k) for k in keys)
    print(
        f"deadline {args.deadline}s, CNI {1.5 * args.deadline}s, {args.pods} pods, "
        f"at most {args.max_requests} requests each"
    )
    for key in keys:
        print(f"{key:<{width}}  " + "  ".join(f"{r[key]!s:<22}" for r in results))


if __name__ == "__main__":
    main()
