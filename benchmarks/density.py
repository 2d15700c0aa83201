"""Pod density under the real kubelet: N static pods at once, a steady minute, all removed.

kubelet (`../shared/kubelet/kubelet`, standalone, its defaults `--cgroups-per-qos=true
--enforce-node-allocatable=pods`, `--sync-frequency=10s`, under a cgroup root of its own:
tests/kubelet.py) is given N pod manifests at once, each a busybox pod with one container,
the image already present. kubelet is given `--node-ip` (the host's address on its default
route), as a node whose name is not in `/etc/hosts` would be: without it, a standalone
kubelet resolves its made-up node name through DNS at every pod admission, and a resolver
that drops queries after a burst stalls its sync loop five seconds at a time (tests/kubelet.py
says more; `--kubelet-arg=--node-ip=` with no value turns it off to measure that). Columns:

- start p50 / p99 (s): manifest written -> kubelet's read-only `/pods` shows the pod
  Running with its container ready (polled every half second);
- runtime CPU (% of a core) in a steady minute after all are ready: the daemon and every
  helper it runs (conmon for cri-shim; the shims for containerd) and every child they
  reaped (runc, CNI plugins), from a cgroup the daemon is moved into at start (cpuacct's
  on cgroup v1, one of the unified tree on v2: `cpu.stat`'s `usage_usec`), and under
  systemd's cgroup driver the transient scope each conmon moves to once its container is
  made;
  the daemon's own CPU (`dm CPU`, from /proc/PID/stat: the part the relay is in);
- kubelet CPU (% of a core) in the same minute, with the children it reaped;
- runtime memory (MiB, and per pod) at the end of the minute: the daemon and its per-pod
  helpers (conmon; containerd's shims and the sandboxes' pause processes), not the runc
  or plugin processes that happen to run at that moment, and the daemon's own, two ways:
  - `alone`: what it would be with the runtime alone on the node, the figure a user sees
    there. Every resident page is divided among the runtime's processes that map it and
    no others (runtime_cost.alone_pss, from /proc/PID/pagemap's frame numbers): the
    runtime's distinct pages, once each. This is the figure to read;
  - `PSS`: the kernel's proportional set size here (smaps_rollup), which divides a
    shared page among every process on the machine that maps it. It is lower than
    `alone` by what others share: this benchmark's own Python process, which imports
    grpc and protobuf from the same venv and maps the same interpreter and system
    libraries as the daemon, and any other process of the same interpreter (libpython
    is a shared library; on a machine running other Python programs, such as other test
    runs, its 5 MiB are divided among all of them), so it moves with whatever else runs.
    The README explains the difference;
- all removed (s): manifests deleted -> kubelet lists no pod and the runtime runs no
  container.

Workloads: `plain` (a sleeping container) and `probe` (the same with an exec readiness
probe every 10 s, which kubelet runs through ExecSync; timeout 5 s so that a busy machine
does not flap it).

`--analyse` adds, for cri-shim, what the start-up and the steady minute cost inside the
daemon: the creation stages' mean durations and every pod's timeline (the daemon's stage
log), the RPCs' counts and mean latencies and the external calls' (its metrics endpoint,
turned on for this), and a py-spy sampling profile of each phase attributed to the RPC
handler on the stack (py-spy must be installed: `.venv/bin/pip install py-spy`). It
perturbs the figures: use it apart from the runs that measure.

`--handler runsc` runs cri-shim's pods under gVisor: kubelet's static pods cannot name a
RuntimeClass without an API server, so the daemon's `[runtime] default_handler` is
`runsc` (`/usr/bin/runsc`, with `runtime_args = ["--network=host"]`, which Debian's
runsc needs on Linux 6.11 and newer). Each gVisor pod adds host processes of its own
outside the daemon's: the Sentry (`runsc-sandbox`), a gofer per container and per pod,
and the waiter conmon waits for per container (a shell and its `runsc wait`). Their PSS
is the `sbx MiB` column (and per pod), beside the runtime's, which then holds the conmons
of the pod's sandbox container too; under runc the column is 0, as a runc pod has no
process of its own. The Sentry's CPU is the pod's (its cgroup's), not the runtime's.
`--handler both` runs runc's and runsc's pods one after the other.

`--cgroup-driver systemd` runs cri-shim's daemon with `cgroup_manager = "systemd"`
(default `cgroupfs`), and kubelet with `--cgroup-driver=systemd`, the one the daemon's
RuntimeConfig answers (tests/kubelet.py: its root is a slice, its pods' cgroups slices
made through systemd); each container is then a scope runc asks systemd for and each
conmon one the daemon asks for, D-Bus round trips the cgroupfs driver does not make.
`--cgroup-driver both` runs each case under cgroupfs's driver, then systemd's, and ends
with systemd's start p50 and p99 and removal time over cgroupfs's. systemd's driver needs
systemd as PID 1 on cgroup v2, as nodes run it: elsewhere it is refused. The QEMU guest
(scripts/guest) is such a node; its `density` lane step runs this with both drivers:

    flock /tmp/guest.lock scripts/guest --lane density leftovers

(GUEST_DENSITY_ARGS, default `--pods 20 --workloads plain --cgroup-driver both --steady
30`, about 4 minutes, sets the arguments: tests/guest/lane.sh; a --timeout of more than
1800 s for many more pods). Under emulation every figure is several times the host's; the
ratio between the drivers is the figure to read there (README, Benchmarks).

`--mode` sets how cri-shim's daemon gets its socket: `relay` (the default) as the unit that
`scripts/install` writes starts it, socket-activated (the socket held by this process as
systemd holds it, descriptor 3), every kubelet call passing through the relay
(server/relay.py); `bound`, the daemon binding the socket itself; `both`, one run of each,
ending with the relay's figures over the bound socket's and the relay's share of the
daemon's steady CPU. Either way the daemon runs with the installed unit's interpreter
options (`python -OO -X no_debug_ranges`) from bytecode compiled so, as scripts/install
compiles it.

`--runtime containerd` runs the same against containerd 1.6 started by
`../shared/peers/containerd/start.sh` (which installs it if missing); the images are
imported with `ctr`, the pause image being the test busybox image sleeping forever (so
nothing is pulled). Never run it while another cri-shim run measures on the same machine.

Usage: sudo .venv/bin/python benchmarks/density.py [--pods 50,110] [--workloads plain,probe]
           [--runtime cri-shim|containerd|both] [--handler runc|runsc|both] [--steady 60]
           [--cgroup-driver cgroupfs|systemd|both] [--mode relay|bound|both]
           [--analyse] [--kubelet-arg=--FLAG=VALUE ...]

The figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import calendar
import collections
import itertools
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx
from common import BYTECODE, compile_as_installed, cpu_seconds, percentiles
from runtime_cost import (
    AloneShare,
    CpuAccount,
    Profiler,
    alone_pss,
    children,
    comm,
    command_lines,
    gvisor_sandbox_processes,
    moved_out_seconds,
    process_cpu_seconds,
    pss_mib,
)

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.host.mounts import unmount_below
from cri_shim.runtime.cgroup_driver import CGROUPFS, SYSTEMD, systemd_booted
from tests.harness import (
    BUSYBOX_IMAGE,
    INSTALLED_FLAGS,
    REPO,
    Daemon,
    import_image,
    make_test_network,
)
from tests.imagebuild import _write_tar, build_image, cached_oci_layout, layout_files
from tests.kubelet import (
    KUBELET,
    LOOP,
    Kubelet,
    cgroup_v2,
    remove_all_sandboxes,
    running_and_ready,
)
from tests.registry import free_port
from tests.waiting import wait_until

RUNSC = Path("/usr/bin/runsc")
# The daemon's configuration per handler its pods run under (kubelet's static pods name
# none: the default handler is the one they get).
HANDLER_SETTINGS: dict[str, dict[str, Any]] = {
    "runc": {},
    "runsc": {
        "runtime": {
            "default_handler": "runsc",
            "handlers": {
                "runc": {"path": "runc"},
                "runsc": {"path": str(RUNSC), "runtime_args": ["--network=host"]},
            },
        }
    },
}
CONTAINERD_PEER = REPO.parent / "shared" / "peers" / "containerd"
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"  # what the peer's containerd runs sandboxes with
# The daemon's handler of each CRI method is the method's name in snake case.
CRI_HANDLERS = {
    re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): name
    for name in dir(api_pb2_grpc.RuntimeServiceServicer) + dir(api_pb2_grpc.ImageServiceServicer)
    if name[0].isupper()
}


class Runtime(Protocol):
    name: str
    mode: str
    driver: str
    endpoint: str
    cpu: CpuAccount

    def cpu_seconds(self) -> float: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def processes(self) -> list[int]: ...
    def sandbox_pss_mib(self) -> float: ...
    def daemon_pid(self) -> int: ...
    def stub(self) -> api_pb2_grpc.RuntimeServiceStub: ...


# How the daemon gets its socket: handed over by systemd's socket activation, as the unit
# scripts/install writes by default starts it (every call then passes through the relay,
# server/relay.py), or bound by the daemon itself.
RELAY, BOUND = "relay", "bound"
MODES = {RELAY: [RELAY], BOUND: [BOUND], "both": [RELAY, BOUND]}


class ShimRuntime:
    """cri-shim as an operator runs it (log level info, the installed unit's interpreter
    options, from bytecode compiled so), on a scratch root, with the bridge and portmap
    plugins on a network of its own, under the cgroup driver given, its socket activated
    (`mode` RELAY) or bound by itself (BOUND)."""

    def __init__(
        self,
        base: Path,
        analyse: bool,
        handler: str = "runc",
        driver: str = CGROUPFS,
        mode: str = RELAY,
    ) -> None:
        self.name = "cri-shim" if handler == "runc" else f"cri-shim/{handler}"
        self.driver = driver
        self.mode = mode
        self.base = base
        self.held: socket.socket | None = None
        self.network = make_test_network(base, 3, slow=False)
        settings: dict[str, Any] = {
            "log_level": "info",
            "cgroup_manager": driver,
            **HANDLER_SETTINGS[handler],
        }
        self.metrics_port = free_port() if analyse else 0
        if analyse:
            settings["metrics"] = {"listen": f"127.0.0.1:{self.metrics_port}"}
        self.daemon = Daemon(
            base, self.network, settings=settings, env=BYTECODE, interpreter_flags=INSTALLED_FLAGS
        )
        self.cpu = CpuAccount(f"crishim-density-{os.getpid()}")
        self.endpoint = f"unix://{self.daemon.socket}"

    def start(self) -> None:
        if self.mode == RELAY:
            # Held here as systemd holds it, the daemon getting it as descriptor 3.
            self.daemon.socket.parent.mkdir(parents=True, exist_ok=True)
            self.held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.held.bind(str(self.daemon.socket))
            self.held.listen(socket.SOMAXCONN)
            self.daemon.pass_fds = (self.held.fileno(),)
        self.daemon.start()
        import_image(self.daemon, cached_oci_layout(self.base / "images"))
        self.cpu.add(self.daemon_pid())

    def daemon_pid(self) -> int:
        assert self.daemon.proc is not None
        return self.daemon.proc.pid

    def stub(self) -> api_pb2_grpc.RuntimeServiceStub:
        return self.daemon.runtime()

    def conmons(self) -> list[int]:
        """The daemon's conmons: its children, as the child subreaper of the conmons that
        double-fork away from it (wherever the cgroup driver put them)."""
        return [pid for pid in children({self.daemon_pid()}) if comm(pid) == "conmon"]

    def cpu_seconds(self) -> float:
        """The account's, and under the systemd driver the conmons' own scopes'."""
        return self.cpu.seconds() + moved_out_seconds(self.cpu, self.conmons())

    def processes(self) -> list[int]:
        """The daemon and its conmons (not a runc or CNI plugin that happens to run)."""
        return [self.daemon_pid(), *self.conmons()]

    def sandbox_pss_mib(self) -> float:
        """The gVisor pods' own host processes: Sentries, gofers, waiters."""
        found = gvisor_sandbox_processes(
            command_lines(),
            self.daemon.run_root / "runtime" / "runsc",
            self.daemon.run_root / "conmon" / "runsc" / "runsc-under-conmon",
        )
        return sum(pss_mib(pid) for pid in found)

    def stop(self) -> None:
        try:
            remove_all_sandboxes(self.stub())
            leaks = self.daemon.leaks()
            if leaks:
                print(f"  {self.name} left behind: {leaks}")
        finally:
            self.daemon.stop()
            if self.held is not None:
                self.held.close()
            self.cpu.remove()
            self.network.remove()

    def metrics(self) -> dict[str, float]:
        """The metrics endpoint's samples, by their full name with labels."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples


class ContainerdRuntime:
    """containerd 1.6 with its CRI plugin, started by the peer's start.sh."""

    name = "containerd"
    driver = CGROUPFS  # the peer's configuration: SystemdCgroup = false
    mode = "-"

    def __init__(self, base: Path) -> None:
        self.base = base
        self.state = base / "containerd"
        self.cpu = CpuAccount(f"containerd-density-{os.getpid()}")
        self.endpoint = f"unix://{self.state}/containerd.sock"
        self._channel: grpc.Channel | None = None
        self.ctr = ["ctr", "--address", f"{self.state}/containerd.sock", "-n", "k8s.io"]

    def start(self) -> None:
        subprocess.run([str(CONTAINERD_PEER / "start.sh"), str(self.state)], check=True)
        self.cpu.add(self.daemon_pid())
        image = build_image()
        pause = build_image(entrypoint=["sleep", "2147483647"], cmd=[])
        for name, built in ((BUSYBOX_IMAGE, image), (PAUSE_IMAGE, pause)):
            archive = _write_tar(self.base / "archive.tar", layout_files(built, name, name))
            subprocess.run(
                [*self.ctr, "images", "import", str(archive)],
                check=True,
                capture_output=True,
            )

    def daemon_pid(self) -> int:
        return int((self.state / "pid").read_text())

    def cpu_seconds(self) -> float:
        return self.cpu.seconds()

    def stub(self) -> api_pb2_grpc.RuntimeServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.endpoint)
        return api_pb2_grpc.RuntimeServiceStub(self._channel)

    def processes(self) -> list[int]:
        """containerd, its shims, and the sandboxes' pause processes (the shims' children
        named as the pause image's program); not a runc that happens to run."""
        shims = {pid for pid in self.cpu.pids() if comm(pid) == "containerd-shim"}
        pauses = [pid for pid in children(shims) if comm(pid) == "sleep"]
        return [self.daemon_pid(), *shims, *pauses]

    def sandbox_pss_mib(self) -> float:
        return 0.0  # runc's pods: the pause processes are counted with the shims

    def stop(self) -> None:
        try:
            remove_all_sandboxes(self.stub())
        finally:
            if self._channel is not None:
                self._channel.close()
            subprocess.run([str(CONTAINERD_PEER / "stop.sh"), str(self.state)], check=False)
            self.cpu.remove()
            for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
                if line.split()[4].startswith(str(self.state)):
                    subprocess.run(["umount", "-l", line.split()[4]], check=False)


@dataclass
class Result:
    runtime: str
    mode: str
    driver: str
    workload: str
    pods: int
    start: list[float] = field(default_factory=list)
    not_ready: int = 0
    runtime_cpu: float = 0.0
    daemon_cpu: float = 0.0
    kubelet_cpu: float = 0.0
    pss: float = 0.0  # the runtime's, as the kernel counts it on this machine
    alone: float = 0.0  # the runtime's, alone on the node (runtime_cost.alone_pss)
    daemon_pss: float = 0.0
    daemon_alone: AloneShare = field(default_factory=AloneShare)
    sandbox_pss: float = 0.0
    removed: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        p50, p99 = percentiles(self.start, 0.99) if self.start else (float("nan"),) * 2
        missing = f"  ({self.not_ready} never ready)" if self.not_ready else ""
        return (
            f"{self.runtime:<14} {self.mode:<5} {self.driver:<8} {self.workload:<6} "
            f"{self.pods:>4}  {p50:6.1f} {p99:6.1f}  "
            f"{self.runtime_cpu:6.1f} {self.daemon_cpu:6.1f} {self.kubelet_cpu:6.1f}  "
            f"{self.alone:6.1f} {self.alone / self.pods:5.2f} {self.daemon_alone.mib:6.1f}  "
            f"{self.pss:6.1f} {self.pss / self.pods:5.2f} {self.daemon_pss:6.1f}  "
            f"{self.sandbox_pss:6.1f} {self.sandbox_pss / self.pods:5.2f}  "
            f"{self.removed:6.1f}{missing}"
        )


HEADER = (
    f"{'runtime':<14} {'mode':<5} {'cgroup':<8} {'load':<6} {'pods':>4}  "
    f"{'p50 s':>6} {'p99 s':>6}  {'rt CPU':>6} {'dm CPU':>6} {'kl CPU':>6}  "
    f"{'alone':>6} {'/pod':>5} {'daemon':>6}  {'PSS':>6} {'/pod':>5} {'daemon':>6}  "
    f"{'sbx':>6} {'/pod':>5}  {'rm s':>6}\n"
    f"{'':<44}{'(% of a core)':^22}  {'(MiB, alone on a node)':^20}  "
    f"{'(MiB, the kernel PSS here)':^20}  {'(MiB)':^12}"
)


# kubelet delays each probe's first run by a random part of its period when it has itself
# been running for less than a period (prober/worker.go: a restarted kubelet should not
# fire every probe at once), so pods are written only once it has run longer than that.
PROBE_PERIOD = 10


def containers(probe: bool) -> list[dict[str, Any]]:
    container: dict[str, Any] = {
        "name": "main",
        "image": BUSYBOX_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", LOOP],
    }
    if probe:
        container["readinessProbe"] = {
            "exec": {"command": ["true"]},
            "periodSeconds": PROBE_PERIOD,
            "timeoutSeconds": 5,
        }
    return [container]


def kubelet_cpu(kubelet: Kubelet) -> float:
    assert kubelet.pid is not None
    return sum(process_cpu_seconds(kubelet.pid))


def running_containers(runtime: Runtime) -> int:
    listed = runtime.stub().ListContainers(api_pb2.ListContainersRequest(), timeout=30)
    return sum(1 for c in listed.containers if c.state == api_pb2.CONTAINER_RUNNING)


# Where a thread waits rather than runs: a sample whose innermost frame is one of these is
# idle (py-spy cannot tell a thread blocked in epoll from one running, in --nonblocking).
IDLE_LEAVES = ("EpollSelector.select", "_worker", "Condition.wait", "Thread.run")


def by_handler(stacks: dict[str, int]) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Samples by the innermost CRI method's handler on the stack ('-' for none), and by the
    function at the top of the stack ("self" time), with the file it is in; idle samples
    left out."""
    handlers: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        frames = stack.split(";")
        names = [f.split(" (")[0].rsplit(".", 1)[-1] for f in frames]
        if frames[-1].split(" (")[0] in IDLE_LEAVES:
            continue
        handler = next((CRI_HANDLERS[n] for n in reversed(names) if n in CRI_HANDLERS), "-")
        if handler == "-" and "_life" in names:
            handler = "(creations, run apart from the RPCs)"
        handlers[handler] += count
        leaf = frames[-1]
        match = re.match(r"(.*) \((.*?):\d+\)", leaf)
        leaves[f"{match.group(1)} ({Path(match.group(2)).name})" if match else leaf] += count
    return handlers, leaves


def print_profile(title: str, stacks: dict[str, int], cpu: float, calls: dict[str, float]) -> None:
    handlers, leaves = by_handler(stacks)
    total = sum(handlers.values()) or 1
    print(f"  {title}: {total} samples, daemon CPU {cpu:.1f} s")
    for handler, count in handlers.most_common(12):
        share = count / total
        n = calls.get(handler, 0)
        per_call = f"{share * cpu / n * 1000:7.2f} ms CPU/call ({n:.0f} calls)" if n else ""
        print(f"    {handler:<28} {share * 100:5.1f} %  {per_call}")
    print("    top functions (self):")
    for leaf, count in leaves.most_common(15):
        print(f"      {count / total * 100:5.1f} %  {leaf}")


def rpc_calls(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    calls: dict[str, float] = collections.defaultdict(float)
    for key, value in after.items():
        if key.startswith("cri_shim_rpc_requests_total{"):
            method = re.search(r'method="([^"]+)"', key)
            if method:
                calls[method.group(1)] += value - before.get(key, 0.0)
    return dict(calls)


def print_metrics(title: str, before: dict[str, float], after: dict[str, float]) -> None:
    """Counts and mean latencies of the RPCs and of the external calls between the two."""
    print(f"  {title}:")
    rows = []
    for key, value in after.items():
        name = key.partition("{")[0]
        if name.endswith("_count") and ("rpc_duration" in key or "host_call_duration" in key):
            count = value - before.get(key, 0.0)
            if count <= 0:
                continue
            seconds = after[key.replace("_count", "_sum")] - before.get(
                key.replace("_count", "_sum"), 0.0
            )
            labels = key[key.index("{") :]
            rows.append((count, labels, seconds / count))
    for count, labels, mean in sorted(rows, reverse=True)[:20]:
        print(f"    {count:7.0f} x  mean {mean * 1000:8.1f} ms  {labels}")


STAGE_LINE = re.compile(
    r"ts=(\S+) .*msg=\"(?:sandbox|container) '([^']+)' \(\w+\): stage ([^\"]+)\""
)


STARTED_LINE = re.compile(r"ts=(\S+) .*msg=\"container \w+ \(([^)]+)\) started\"")
# kubelet's klog lines: `I1202 08:06:51.416501 pid file:line] "message" ... pod="ns/name"`.
KUBELET_LINE = re.compile(r"^I(\d{4} \d\d:\d\d:\d\d\.\d+) .*?\] \"([^\"]+)\"(.*)$")
KUBELET_MARKS = {
    "SyncLoop ADD": "kubelet: manifest read",
    "No sandbox for pod can be found. Need to start a new one": "kubelet: RunPodSandbox sent",
}


def pod_of(cri_name: str) -> str:
    """The static pod's name in kubelet's CRI names: k8s_POD_<pod>_<namespace>_<uid>_<n>
    for a sandbox, k8s_<container>_<pod>_... for a container; <pod> is <name>-<node>."""
    return cri_name.split("_")[2].rsplit("-", 1)[0]


def start_marks(daemon_log: Path, kubelet_log: Path) -> dict[str, list[tuple[float, str]]]:
    """By pod: the moments of its start that kubelet's log and the daemon's stage log
    show (the first of each kind only: a sandbox made again later is not the start)."""
    events: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for line in daemon_log.read_text(errors="replace").splitlines():
        if match := STAGE_LINE.search(line):
            stamp, name, stage = match.groups()
            events[pod_of(name)].setdefault(stage, _epoch(stamp))
        elif match := STARTED_LINE.search(line):
            stamp, name = match.groups()
            events[pod_of(name)].setdefault("container started", _epoch(stamp))
    year = time.gmtime().tm_year
    for line in kubelet_log.read_text(errors="replace").splitlines():
        match = KUBELET_LINE.match(line)
        if not match or match.group(2) not in KUBELET_MARKS:
            continue
        stamp = time.strptime(f"{year}{match.group(1).split('.')[0]}", "%Y%m%d %H:%M:%S")
        moment = calendar.timegm(stamp) + float("0." + match.group(1).split(".")[1])
        for pod in re.findall(r"default/([\w.-]+)", match.group(3)):
            events[pod.rsplit("-", 1)[0]].setdefault(KUBELET_MARKS[match.group(2)], moment)
    return {pod: sorted((t, label) for label, t in marks.items()) for pod, marks in events.items()}


def print_timelines(
    daemon_log: Path, kubelet_log: Path, written: dict[str, float], ready: dict[str, float]
) -> None:
    """Every pod's start: seconds after its manifest was written at which kubelet and the
    daemon reached each mark; then the time from each mark to the next over all pods."""
    marks = start_marks(daemon_log, kubelet_log)
    print("  per-pod start (s after the manifest was written):")
    gaps: dict[str, list[float]] = collections.defaultdict(list)
    order = sorted(written, key=lambda p: ready.get(p, 1e9))
    for pod in order:
        pod_marks = marks.get(pod, [])
        done = ready.get(pod)
        if pod in (order[0], order[len(order) // 2], order[-1]):
            shown = "  ".join(f"{label}@{t - written[pod]:.2f}" for t, label in pod_marks)
            end = f"ready@{done - written[pod]:.2f}" if done else "never ready"
            print(f"    {pod}: {shown}  {end}")
        previous, previous_label = written[pod], "manifest written"
        for t, label in pod_marks:
            gaps[f"{previous_label} -> {label}"].append(t - previous)
            previous, previous_label = t, label
        if done:
            gaps[f"{previous_label} -> ready in /pods"].append(done - previous)
    print("  from each mark to the next (median / p90 / max over pods, s):")
    for label, values in gaps.items():
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
        print(f"    {label:<62} {statistics.median(values):6.2f} {p90:6.2f} {max(values):6.2f}")


def _epoch(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run_one(runtime: Runtime, base: Path, pods: int, workload: str, args: Any) -> Result:
    result = Result(runtime.name, runtime.mode, runtime.driver, workload, pods)
    node = f"dn{os.getpid() % 100000}{runtime.driver[0]}{workload}{pods}"
    runtime.start()
    kubelet = Kubelet(base / "node", runtime.endpoint, node, extra_args=list(args.kubelet_arg))
    analyse = isinstance(runtime, ShimRuntime) and args.analyse
    profiler: Profiler | None = None
    try:
        kubelet.start()
        # kubelet's first syncs and housekeeping; past the probe period for probes' sake
        time.sleep(PROBE_PERIOD + 2 if workload == "probe" else 5)
        names = [f"d{i}" for i in range(pods)]
        metrics0 = runtime.metrics() if analyse else {}
        daemon0 = process_cpu_seconds(runtime.daemon_pid())
        cpu0 = runtime.cpu_seconds()
        if analyse:
            profiler = Profiler(runtime.daemon_pid(), base / "start.raw")
        written: dict[str, float] = {}
        for name in names:
            kubelet.write_pod(name, containers(workload == "probe"))
            written[name] = time.time()
        ready: dict[str, float] = {}
        deadline = time.monotonic() + args.start_timeout
        while len(ready) < pods and time.monotonic() < deadline:
            seen = kubelet.pods()
            now = time.time()
            for name in names:
                if name not in ready and running_and_ready(seen.get(name)):
                    ready[name] = now
            time.sleep(0.5)
        result.start = [ready[n] - written[n] for n in ready]
        result.not_ready = pods - len(ready)
        daemon1 = process_cpu_seconds(runtime.daemon_pid())
        cpu1 = runtime.cpu_seconds()
        print(
            f"  start of {pods}: runtime CPU {cpu1 - cpu0:.1f} s in all "
            f"({(cpu1 - cpu0) / pods * 1000:.0f} ms per pod; the daemon itself "
            f"{(daemon1[0] - daemon0[0]) / pods * 1000:.0f} ms, the children it reaped "
            f"{(daemon1[1] - daemon0[1]) / pods * 1000:.0f} ms, the rest being its helpers)"
        )
        if analyse:
            assert isinstance(runtime, ShimRuntime) and profiler is not None
            metrics1 = runtime.metrics()
            print_profile("profile of the start", profiler.finish(), daemon1[0] - daemon0[0], {})
            print_metrics("RPCs and external calls during the start", metrics0, metrics1)
            print_creation_stages(runtime)
            print_timelines(runtime.daemon.log_path, kubelet.log_path, written, ready)

        time.sleep(5)  # the last probes' and status updates' tail
        metrics0 = runtime.metrics() if analyse else {}
        if analyse:
            profiler = Profiler(runtime.daemon_pid(), base / "steady.raw")
        cpu0, kl0, daemon0 = (
            runtime.cpu_seconds(),
            kubelet_cpu(kubelet),
            process_cpu_seconds(runtime.daemon_pid()),
        )
        started = time.monotonic()
        time.sleep(args.steady)
        took = time.monotonic() - started
        cpu1, kl1, daemon1 = (
            runtime.cpu_seconds(),
            kubelet_cpu(kubelet),
            process_cpu_seconds(runtime.daemon_pid()),
        )
        result.runtime_cpu = (cpu1 - cpu0) / took * 100
        result.daemon_cpu = (daemon1[0] - daemon0[0]) / took * 100
        result.kubelet_cpu = (kl1 - kl0) / took * 100
        processes = runtime.processes()
        result.pss = sum(pss_mib(pid) for pid in processes)
        result.daemon_pss = pss_mib(processes[0])
        shares = alone_pss(processes)
        result.alone = sum(share.mib for share in shares.values())
        result.daemon_alone = shares[processes[0]]
        result.notes.append(
            f"the daemon alone {result.daemon_alone.mib:.1f} MiB, of which "
            f"{result.daemon_alone.system_libraries_mib:.1f} in system libraries that a "
            "node's other processes map too"
        )
        result.sandbox_pss = runtime.sandbox_pss_mib()
        if analyse:
            assert isinstance(runtime, ShimRuntime) and profiler is not None
            metrics1 = runtime.metrics()
            calls = rpc_calls(metrics0, metrics1)
            print_profile(
                f"profile of the steady {took:.0f} s",
                profiler.finish(),
                daemon1[0] - daemon0[0],
                calls,
            )
            print_metrics("RPCs and external calls in the steady minute", metrics0, metrics1)
            print_rpc_costs(runtime)
            lag = runtime.daemon.status_info().get("eventLoop")
            print(f"  the daemon's event loop lag (Status verbose): {lag}")

        removing = time.monotonic()
        for name in names:
            kubelet.remove_pod(name)
        wait_until(
            lambda: not kubelet.pods() and not running_containers(runtime),
            timeout=args.start_timeout,
            interval=0.5,
        )
        result.removed = time.monotonic() - removing
    finally:
        if profiler is not None and profiler.proc.poll() is None:
            profiler.proc.kill()
        kubelet.stop()  # before the pods are removed: it would make them again
        try:
            runtime.stop()
        finally:
            for left in kubelet.cleanup():
                result.notes.append(f"kubelet left {left}")
    return result


def print_rpc_costs(runtime: ShimRuntime, calls: int = 40) -> None:
    """The daemon's CPU per call of the RPCs kubelet makes most, each called `calls` times
    in a row, less what the daemon spends meanwhile on kubelet's own calls (measured
    just before, as a rate)."""
    stub, pid = runtime.stub(), runtime.daemon_pid()
    sandboxes = stub.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items
    listed = stub.ListContainers(api_pb2.ListContainersRequest(), timeout=30).containers
    sandbox_id, container_id = sandboxes[0].id, listed[0].id
    rpcs: list[tuple[str, Any]] = [
        ("ListPodSandbox", lambda: stub.ListPodSandbox(api_pb2.ListPodSandboxRequest())),
        ("ListContainers", lambda: stub.ListContainers(api_pb2.ListContainersRequest())),
        (
            "PodSandboxStatus",
            lambda: stub.PodSandboxStatus(
                api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)
            ),
        ),
        (
            "ContainerStatus",
            lambda: stub.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id)),
        ),
        (
            "ListContainerStats",
            lambda: stub.ListContainerStats(api_pb2.ListContainerStatsRequest()),
        ),
        (
            "ListPodSandboxStats",
            lambda: stub.ListPodSandboxStats(api_pb2.ListPodSandboxStatsRequest()),
        ),
        ("Version", lambda: stub.Version(api_pb2.VersionRequest())),
    ]
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(5)
    background = (cpu_seconds(pid) - before) / (time.monotonic() - started)
    print(
        f"  the daemon's CPU per call, {len(sandboxes)} sandboxes and {len(listed)} containers "
        f"held (kubelet's own calls meanwhile, {background * 1000:.1f} ms/s, taken off):"
    )
    for name, call in rpcs:
        before, started = cpu_seconds(pid), time.monotonic()
        for _ in range(calls):
            call()
        took = time.monotonic() - started
        spent = cpu_seconds(pid) - before - background * took
        print(f"    {name:<22} {spent / calls * 1000:7.2f} ms CPU  ({took / calls * 1000:.1f} ms)")


def print_creation_stages(runtime: ShimRuntime) -> None:
    """The mean time creations spent in each stage (Status verbose)."""
    info = runtime.daemon.status_info()["creation"]
    for kind in ("sandbox", "container"):
        figures = info[kind]
        entered, seconds = figures["stages_entered"], figures["stage_seconds"]
        means = ", ".join(
            f"{stage} {seconds[stage] / entered[stage]:.2f}"
            for stage in entered
            if entered[stage] and stage in seconds
        )
        print(f"  {kind} creation stages, mean s: {means}")


DRIVERS = {CGROUPFS: [CGROUPFS], SYSTEMD: [SYSTEMD], "both": [CGROUPFS, SYSTEMD]}


def driver_refusal(choice: str, runtime: str, *, systemd_running: bool, v2: bool) -> str:
    """Why `--cgroup-driver choice` cannot be measured here ("" when it can): systemd's
    driver is cri-shim's alone here (the containerd peer is set to cgroupfs), and is
    measured where nodes run it, with systemd as PID 1 on cgroup v2."""
    if choice == CGROUPFS:
        return ""
    if runtime != "cri-shim":
        return (
            f"--cgroup-driver {choice}: the containerd peer runs the cgroupfs driver "
            "(SystemdCgroup = false); measure systemd's with --runtime cri-shim"
        )
    if not (systemd_running and v2):
        host = (
            f"{'systemd' if systemd_running else 'no systemd'} as PID 1, "
            f"cgroup {'v2' if v2 else 'v1'}"
        )
        return (
            f"--cgroup-driver {choice} needs systemd as PID 1 on cgroup v2 (here: {host}); "
            "run it in the guest: scripts/guest --lane density"
        )
    return ""


def paired(
    results: list[Result], attribute: str, over: str, base: str
) -> Iterator[tuple[Result, Result, str]]:
    """Each run whose `attribute` (driver or mode) is `over`, with the same run whose
    `attribute` is `base`, and the ratios of their start p50 and p99 (over's over base's)."""
    same = ("runtime", "mode", "driver", "workload", "pods")
    key = [name for name in same if name != attribute]
    bases = {
        tuple(getattr(r, name) for name in key): r for r in results if getattr(r, attribute) == base
    }
    for result in results:
        other = bases.get(tuple(getattr(result, name) for name in key))
        if (
            getattr(result, attribute) != over
            or other is None
            or not result.start
            or not other.start
        ):
            continue
        p50, p99 = percentiles(result.start, 0.99)
        base50, base99 = percentiles(other.start, 0.99)
        yield result, other, f"start p50 x{p50 / base50:.2f}, p99 x{p99 / base99:.2f}"


def driver_ratios(results: list[Result]) -> list[str]:
    """Each run under systemd's driver against the same run under cgroupfs's: the ratios
    of their start p50 and p99 and of their removal times (systemd's over cgroupfs's)."""
    return [
        f"{result.runtime} {result.workload} {result.pods} pods: {starts}, "
        f"removal x{result.removed / other.removed:.2f}"
        for result, other, starts in paired(results, "driver", SYSTEMD, CGROUPFS)
    ]


def mode_ratios(results: list[Result]) -> list[str]:
    """Each cri-shim run through the relay against the same run on a bound socket: the
    ratios of start p50 and p99, the runtime's and the daemon's steady CPU and the removal
    (relay's over bound's), and the daemon's steady CPU the relay adds, as a share of the
    relayed daemon's (what the daemon spends in the relay, as far as the two runs' noise
    lets it show)."""
    lines = []
    for result, other, starts in paired(results, "mode", RELAY, BOUND):
        share = (result.daemon_cpu - other.daemon_cpu) / result.daemon_cpu * 100
        lines.append(
            f"{result.runtime} {result.driver} {result.workload} {result.pods} pods: {starts}, "
            f"runtime CPU x{result.runtime_cpu / other.runtime_cpu:.2f}, "
            f"daemon CPU x{result.daemon_cpu / other.daemon_cpu:.2f} "
            f"({result.daemon_cpu:.2f} against {other.daemon_cpu:.2f} % of a core: "
            f"the relay's share {share:+.0f} %), alone PSS x{result.alone / other.alone:.2f}, "
            f"removal x{result.removed / other.removed:.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", default="50,110")
    parser.add_argument("--workloads", default="plain,probe")
    parser.add_argument("--runtime", default="cri-shim", choices=["cri-shim", "containerd", "both"])
    parser.add_argument("--handler", default="runc", choices=["runc", "runsc", "both"])
    parser.add_argument("--cgroup-driver", default=CGROUPFS, choices=list(DRIVERS))
    parser.add_argument(
        "--mode",
        default=RELAY,
        choices=list(MODES),
        help="cri-shim's socket: activated, through the relay, as the installed unit runs "
        "it (relay), bound by the daemon (bound), or one run of each (both)",
    )
    parser.add_argument("--steady", type=float, default=60.0)
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--analyse", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the logs and profiles")
    parser.add_argument(
        "--kubelet-arg",
        action="append",
        default=[],
        help="one more kubelet flag, after (and so over) the defaults, e.g. "
        "--kubelet-arg=--cgroups-per-qos=false --kubelet-arg=--enforce-node-allocatable=",
    )
    args = parser.parse_args()
    if not KUBELET.exists():
        sys.exit(f"no kubelet at {KUBELET}")
    if args.handler != "runc" and not RUNSC.exists():
        sys.exit(f"no runsc at {RUNSC} (Debian's package: runsc)")
    refusal = driver_refusal(
        args.cgroup_driver, args.runtime, systemd_running=systemd_booted(), v2=cgroup_v2()
    )
    if refusal:
        sys.exit(refusal)
    handlers = ["runc", "runsc"] if args.handler == "both" else [args.handler]
    runtimes = [f"cri-shim/{handler}/{mode}" for handler in handlers for mode in MODES[args.mode]]
    if args.runtime != "cri-shim":
        runtimes = ["containerd"] if args.runtime == "containerd" else [*runtimes, "containerd"]
    if args.runtime != "containerd":
        compile_as_installed()
    results = []
    for pods in [int(n) for n in args.pods.split(",")]:
        for workload in args.workloads.split(","):
            for name, driver in itertools.product(runtimes, DRIVERS[args.cgroup_driver]):
                base = Path(tempfile.mkdtemp(prefix="csd-", dir="/tmp"))
                base.chmod(0o711)
                runtime: Runtime
                if name.startswith("cri-shim/"):
                    _, handler, mode = name.split("/")
                    runtime = ShimRuntime(base, args.analyse, handler, driver, mode)
                else:
                    runtime = ContainerdRuntime(base)
                print(f"{name}, {driver} driver, {pods} pods, {workload}:", flush=True)
                try:
                    results.append(run_one(runtime, base, pods, workload, args))
                finally:
                    # The daemon leaves its namespace pin directories mounted (shared).
                    unmount_below(base)
                    if args.keep:
                        print(f"  kept {base}")
                    else:
                        shutil.rmtree(base, ignore_errors=True)
                print(HEADER)
                print(results[-1].line(), flush=True)
                for note in results[-1].notes:
                    print(f"  {note}")
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\nall runs ({os.cpu_count()} cores, load average now {' '.join(loadavg)}):")
    print(HEADER)
    for result in results:
        print(result.line())
    ratios = driver_ratios(results)
    if ratios:
        print("\nsystemd's driver over cgroupfs's (start p50, p99; all removed):")
        for line in ratios:
            print(f"  {line}")
    ratios = mode_ratios(results)
    if ratios:
        print("\nthe relay over a bound socket:")
        for line in ratios:
            print(f"  {line}")


if __name__ == "__main__":
    main()
