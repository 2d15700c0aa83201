"""The runtime side's memory: the daemon's idle, with N pods held (one running container
each), and across many pod cycles (a leak test: RSS sampled every 100 cycles, after a
warm-up).

Usage: sudo .venv/bin/python benchmarks/memory.py [--held 50,110] [--cycles 1000]
                                                  [--as-installed] [--burst]

--burst starts each count's new pods all at once, as kubelet does with its static pods
(by default one after another): a burst leaves the daemon's heaps more fragmented.

--as-installed runs the daemon as the installed unit does (`python -OO -X no_debug_ranges`,
from bytecode compiled under those options, as scripts/install compiles it): the figures
the README gives.

For the daemon it prints the proportional set size (PSS: shared pages divided among the
processes that map them), the unique set size (USS: pages no other process maps), the
anonymous part (the heap: what the daemon's own code and data cost) and its threads; for
the conmons (one per container) their PSS, in all and per pod; and the runtime side's
PSS (the daemon plus every conmon, what the density benchmark counts) per pod, and the
same as if the runtime were alone on the node (`alone`: runtime_cost.alone_pss, the
figure density.py gives). Pods are
held while kubelet-like reads run (lists, statuses and stats, as its relist does), so
that what those reads keep is counted too.

Each cycle is RunPodSandbox, CreateContainer, StartContainer, StopPodSandbox,
RemovePodSandbox, serially. The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common import (
    BYTECODE,
    bench_daemon,
    compile_as_installed,
    pod_with_container,
    rss_mib,
)
from runtime_cost import alone_pss, children, comm

from cri_shim.api.v1 import api_pb2
from tests.harness import INSTALLED_FLAGS, Daemon, import_image
from tests.imagebuild import cached_oci_layout


@dataclass
class Footprint:
    """One process's memory (MiB) from /proc/PID/smaps_rollup and its thread count."""

    rss: float = 0.0
    pss: float = 0.0
    uss: float = 0.0
    anonymous: float = 0.0
    threads: int = 0

    @classmethod
    def of(cls, pid: int) -> Footprint:
        fields: dict[str, int] = {}
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return cls()  # it exited while we looked
        for line in rollup:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0])
        threads = next(
            int(line.split()[1]) for line in status.splitlines() if line[:8] == "Threads:"
        )
        return cls(
            rss=fields["Rss"] / 1024,
            pss=fields["Pss"] / 1024,
            uss=(fields["Private_Clean"] + fields["Private_Dirty"]) / 1024,
            anonymous=fields["Anonymous"] / 1024,
            threads=threads,
        )


def conmons(daemon_pid: int) -> list[int]:
    """The conmons the daemon started (it is their subreaper: they are its children)."""
    return [pid for pid in children({daemon_pid}) if comm(pid) == "conmon"]


def kubelet_reads(daemon: Daemon) -> None:
    """What kubelet's relist and its stats provider ask for, once each."""
    rt = daemon.runtime()
    pods = rt.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=60).items
    containers = rt.ListContainers(api_pb2.ListContainersRequest(), timeout=60).containers
    for pod in pods:
        rt.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.id), timeout=60)
    for container in containers:
        rt.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container.id), timeout=60)
    rt.ListContainerStats(api_pb2.ListContainerStatsRequest(), timeout=60)
    rt.ListPodSandboxStats(api_pb2.ListPodSandboxStatsRequest(), timeout=60)


def remove_pod(daemon: Daemon, sandbox_id: str) -> None:
    rt = daemon.runtime()
    rt.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
    rt.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)


def report(label: str, daemon_pid: int, pods: int) -> None:
    own = Footprint.of(daemon_pid)
    helper_pids = conmons(daemon_pid)
    helpers = [Footprint.of(pid) for pid in helper_pids]
    helpers_pss = sum(h.pss for h in helpers)
    line = (
        f"{label:<20} daemon RSS {own.rss:5.1f}  PSS {own.pss:5.1f}  USS {own.uss:5.1f}"
        f"  anonymous {own.anonymous:5.1f}  threads {own.threads:3d}"
    )
    shares = alone_pss([daemon_pid, *helper_pids])
    alone = sum(share.mib for share in shares.values())
    line += f"  alone {shares[daemon_pid].mib:5.1f}"
    if pods:
        runtime_side = own.pss + helpers_pss
        line += (
            f" | {len(helpers)} conmons PSS {helpers_pss:5.1f} ({helpers_pss / pods:.2f}/pod)"
            f" | runtime side {runtime_side:5.1f} ({runtime_side / pods:.2f}/pod),"
            f" alone {alone:5.1f} ({alone / pods:.2f}/pod)"
        )
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--held", default="50,110", help="pod counts to measure, ascending")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before a sample")
    parser.add_argument(
        "--burst", action="store_true", help="start each count's new pods all at once"
    )
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE in the daemon's environment"
    )
    parser.add_argument(
        "--from-source",
        action="store_true",
        help="let the daemon compile its modules at start (as PYTHONDONTWRITEBYTECODE=1 does)",
    )
    parser.add_argument(
        "--as-installed",
        action="store_true",
        help=f"run the daemon as the installed unit does ({' '.join(INSTALLED_FLAGS)}, "
        "from bytecode compiled so)",
    )
    args = parser.parse_args()
    env = {} if args.from_source else BYTECODE
    env = dict(env, **dict(item.split("=", 1) for item in args.env))
    flags = INSTALLED_FLAGS if args.as_installed else []
    if args.as_installed:
        compile_as_installed()
    counts = [int(n) for n in args.held.split(",") if n]
    print("MiB; PSS and USS from /proc/PID/smaps_rollup")
    daemon_run = bench_daemon(slow_cni=False, env=env, interpreter_flags=flags)
    with daemon_run as daemon, tempfile.TemporaryDirectory() as scratch:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        time.sleep(args.settle)
        report("idle", pid, 0)
        import_image(daemon, cached_oci_layout(Path(scratch)))
        held: list[str] = []
        for count in counts:
            names = [f"held-{n}" for n in range(len(held), count)]
            if args.burst:
                with ThreadPoolExecutor(max(1, len(names))) as pool:
                    held.extend(pool.map(lambda name: pod_with_container(daemon, name), names))
            else:
                held.extend(pod_with_container(daemon, name) for name in names)
            kubelet_reads(daemon)
            time.sleep(args.settle)
            report(f"with {count} pods", pid, count)
        for sandbox_id in held:
            remove_pod(daemon, sandbox_id)
        time.sleep(args.settle)
        report("after removing them", pid, 0)
        if args.cycles <= 0:
            return
        samples: list[tuple[int, float]] = []
        started = time.perf_counter()
        for cycle in range(1, args.warmup + args.cycles + 1):
            remove_pod(daemon, pod_with_container(daemon, f"cycle-{cycle}"))
            if cycle == args.warmup or (cycle > args.warmup and (cycle - args.warmup) % 100 == 0):
                samples.append((cycle - args.warmup, rss_mib(pid)))
        took = time.perf_counter() - started
        leaks = daemon.leaks()
    print(f"pod cycles (after {args.warmup} warm-up cycles), {took:.0f} s in all (RSS):")
    for cycle, rss in samples:
        print(f"  after {cycle:5d} cycles                {rss:6.1f} MiB")
    growth = samples[-1][1] - samples[0][1]
    per_100 = growth / max(1, samples[-1][0]) * 100
    print(f"{'growth over the cycles':<34} {growth:+6.1f} MiB ({per_100:+.2f} MiB per 100)")
    print(f"{'leaks after the cycles':<34} {leaks or 'none'}")


if __name__ == "__main__":
    main()
