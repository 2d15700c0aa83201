"""A real kubelet run standalone against a CRI runtime, for scenarios and benchmarks.

kubelet is `../shared/kubelet/kubelet` beside the clone (`KUBELET`; callers skip without
it). It runs static pods from a manifest directory, with no API server, and serves its view
of them on its read-only port (`GET /pods`, `/stats/summary`). The static pods scenario,
the soak and the density benchmark all run it from here.

It runs with kubelet's own cgroup defaults, as nodes do: `--cgroups-per-qos=true
--enforce-node-allocatable=pods`, so every pod's `cgroup_parent` is
`<root>/kubepods/<qos>/pod<uid>` (the guaranteed class sits right under `kubepods`). The
root is a cgroup of the kubelet's own (`/<node>`), made before it starts and removed after
it stops: kubelet deletes, killing what runs in them, the pod cgroups under its
`kubepods` that it does not know, so two kubelets on one machine must never share one.

Its cgroup driver is the runtime's, as kubeadm's nodes have it: the one RuntimeConfig
answers. With systemd's, each of those cgroups is a slice (the root `<node>.slice`, a
pod `<node>-kubepods-besteffort-pod<uid>.slice` nested by systemd's dashes), and the
root slice is started through systemd before kubelet, which refuses a root that is not
there, and stopped after it.

It is given `--node-ip`: the host's address on its default route. Without an API server,
kubelet builds its node object afresh each time it needs one (every pod admission, every
pod sync's mirror-pod check), and without a node IP each build resolves the node name
through DNS. The node names here are made up, so each lookup went to the resolver of
`/etc/resolv.conf`; a resolver that answers a burst of queries and then drops them (one
such answered 20 and dropped the rest for five seconds) stalled kubelet's whole sync loop
five seconds at a time while the pods waited, whatever the runtime. A real node has its
name in `/etc/hosts` or its IP given, so neither test nor benchmark should depend on a
resolver.
"""

from __future__ import annotations

import ipaddress
import json
import re
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.host.mounts import unmount_below
from cri_shim.runtime.cgroup_driver import expand_slice
from tests.harness import REPO
from tests.mountinfo import mount_points
from tests.registry import free_port
from tests.waiting import wait_until

KUBELET = REPO.parent / "shared" / "kubelet" / "kubelet"
POD_LOGS = Path("/var/log/pods")  # kubelet's, fixed: this build takes no --config
CONTAINER_LOGS = Path("/var/log/containers")
# A container that stops at once on SIGTERM (a shell as PID 1 ignores it otherwise).
LOOP = "trap 'exit 0' TERM; while true; do sleep 1; done"


def cgroup_hierarchies() -> list[Path]:
    """Where each cgroup hierarchy is mounted: one per v1 controller (and the named
    `systemd` one) on a hybrid host, the unified tree on a v2 host."""
    found: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        if after.split()[0] in ("cgroup", "cgroup2"):
            found.append(Path(before.split()[4]))
    return found


def cgroup_v2() -> bool:
    """The unified hierarchy is mounted at /sys/fs/cgroup (a v2 host, not v1 or hybrid)."""
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


def delegate_every_controller(hierarchy: Path) -> None:
    """On cgroup v2, every controller the root has enabled for its children, as a node
    running kubelet with the cgroupfs driver has it: kubelet refuses a `--cgroup-root`
    without cpu, cpuset or hugetlb, which systemd enables at the root only for a unit that
    asks (a boot with no Delegate= unit started leaves `io memory pids`)."""
    subtree = hierarchy / "cgroup.subtree_control"
    if not subtree.exists():
        return
    enabled = set(subtree.read_text().split())
    missing = [
        c for c in (hierarchy / "cgroup.controllers").read_text().split() if c not in enabled
    ]
    if missing:
        subtree.write_text(" ".join(f"+{controller}" for controller in missing))


def runtime_cgroup_driver(endpoint: str) -> str:
    """The cgroup driver the runtime at `endpoint` runs (its RuntimeConfig answer), which
    kubelet must run too: `cgroupfs` or `systemd`; `cgroupfs` from a runtime that predates
    RuntimeConfig (containerd 1.6, the density benchmark's peer), as kubelet then keeps
    its own `--cgroup-driver`, cgroupfs by default."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            answer = api_pb2_grpc.RuntimeServiceStub(channel).RuntimeConfig(
                api_pb2.RuntimeConfigRequest(), timeout=30
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return "cgroupfs"
    return "systemd" if answer.linux.cgroup_driver == api_pb2.SYSTEMD else "cgroupfs"


def systemctl(*args: str) -> None:
    subprocess.run(["systemctl", *args], check=True, capture_output=True, timeout=120)


def node_ip() -> str | None:
    """The address the host sends from on its default route (chosen by the kernel for a
    UDP socket connected to a documentation address: nothing is sent), or None on a host
    without one, where kubelet is left to find its address itself."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@dataclass
class Kubelet:
    """One kubelet process, standalone (no API server), with fresh ports on each start.

    It looks at its manifests every `file_check_frequency` and syncs every pod every
    `sync_frequency` (by default as ../shared/kubelet/README.md runs it); `extra_args`
    go after its own flags. Its `cgroup_driver` is the runtime's, asked at its first
    start."""

    base: Path
    endpoint: str
    node: str
    sync_frequency: str = "10s"
    file_check_frequency: str = "5s"
    extra_args: list[str] = field(default_factory=list)
    cgroup_driver: str = ""
    proc: subprocess.Popen[bytes] | None = None
    read_only_port: int = 0
    starts: int = 0
    # PIDs of the other kubelets seen running on this machine while this one ran.
    others_seen: set[int] = field(default_factory=set)

    @property
    def root(self) -> Path:
        return self.base / "kubelet"

    @property
    def manifests(self) -> Path:
        return self.base / "manifests"

    @property
    def log_path(self) -> Path:
        return self.base / "kubelet.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def cgroup_root(self) -> str:
        """`--cgroup-root`: this kubelet's `kubepods` and every pod cgroup are below it."""
        return f"/{self.node}"

    @property
    def systemd(self) -> bool:
        return self.cgroup_driver == "systemd"

    @property
    def root_slice(self) -> str:
        """The unit of `--cgroup-root` under systemd's driver."""
        return f"{self.node}.slice"

    @property
    def top_cgroup(self) -> str:
        """The cgroup of `--cgroup-root`, below each hierarchy's root."""
        return expand_slice(self.root_slice) if self.systemd else self.cgroup_root

    def __post_init__(self) -> None:
        for path in (self.root, self.manifests):
            path.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        """The command line, with the current read-only port and two fresh ones; a flag
        of `extra_args` takes the place of the default of that name (a list flag given
        twice would add to it rather than replace it)."""
        given = {arg.partition("=")[0] for arg in self.extra_args}
        defaults = [
            str(KUBELET),
            f"--container-runtime-endpoint={self.endpoint}",
            f"--image-service-endpoint={self.endpoint}",
            f"--pod-manifest-path={self.manifests}",
            f"--file-check-frequency={self.file_check_frequency}",
            f"--sync-frequency={self.sync_frequency}",
            f"--cgroup-driver={self.cgroup_driver or 'cgroupfs'}",
            "--cgroups-per-qos=true",
            "--enforce-node-allocatable=pods",
            f"--cgroup-root={self.cgroup_root}",
            "--fail-swap-on=false",
            # On a cgroup v2 host kubelet is held to what production nodes are: it refuses
            # to start on v1. This machine's v1 hybrid hierarchy needs the flag off.
            f"--fail-cgroupv1={'true' if cgroup_v2() else 'false'}",
            f"--root-dir={self.root}",
            f"--cert-dir={self.root / 'pki'}",
            f"--hostname-override={self.node}",
            *([f"--node-ip={ip}"] if (ip := node_ip()) else []),
            "--register-node=false",
            "--anonymous-auth=true",
            "--authentication-token-webhook=false",
            "--authorization-mode=AlwaysAllow",
            "--address=127.0.0.1",
            f"--port={free_port()}",
            f"--read-only-port={self.read_only_port}",
            "--healthz-bind-address=127.0.0.1",
            f"--healthz-port={free_port()}",  # this build serves /healthz on the read-only port
            "--v=2",
        ]
        return [arg for arg in defaults if arg.partition("=")[0] not in given] + self.extra_args

    def start(self, timeout: float = 60) -> None:
        if not self.cgroup_driver:
            self.cgroup_driver = runtime_cgroup_driver(self.endpoint)
        self.make_cgroup_root()
        self.read_only_port = free_port()
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts}\n".encode())
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log)
        self.starts += 1
        try:
            wait_until(self._healthy, timeout=timeout, interval=0.2)
        except TimeoutError:
            raise TimeoutError(f"kubelet not healthy in {timeout}s:\n{self.log()}") from None

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"kubelet exited with {self.proc.returncode}:\n{self.log()}")
        try:
            url = f"http://127.0.0.1:{self.read_only_port}/healthz"
            return httpx.get(url, timeout=2).text == "ok"
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> list[str]:
        """Everything this kubelet left on the host, once its pods are gone from the
        runtime: the process stopped, its root unmounted, its pods' logs under /var/log
        and its cgroups removed. Returns what was left behind: the mounts that would not
        go and the cgroups that could not be removed (something still runs in them)."""
        self.stop()
        self.unmount()
        self.remove_logs()
        left = [f"mount {p}" for p in self.mounts()]
        return left + self.remove_cgroups()

    def unmount(self) -> None:
        """kubelet bind-mounts its root directory onto itself, once per start."""
        for _ in range(self.starts + 1):
            if not self.mounts():
                return
            unmount_below(self.root)

    def mounts(self) -> list[Path]:
        """The mount points at or below kubelet's root directory."""
        return [p for p in mount_points() if p == self.root or self.root in p.parents]

    # ---- its cgroups ----------------------------------------------------------------

    def make_cgroup_root(self) -> None:
        """kubelet refuses a `--cgroup-root` that does not exist in every hierarchy."""
        for hierarchy in cgroup_hierarchies():
            delegate_every_controller(hierarchy)
        if self.systemd:
            # systemd makes the slice's cgroup, with the controllers its children use.
            systemctl("start", self.root_slice)
            return
        for hierarchy in cgroup_hierarchies():
            path = hierarchy / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            # A new v1 cpuset has no CPUs and no memory nodes: nothing could run below it.
            # (An empty one on v2 uses its parent's; the v2 root has none to copy.)
            for name in ("cpuset.cpus", "cpuset.mems"):
                mine = path / name
                if (hierarchy / name).exists() and mine.exists() and not mine.read_text().strip():
                    mine.write_text((hierarchy / name).read_text())

    def cgroups(self) -> list[Path]:
        """Every cgroup below this kubelet's root, deepest first."""
        found: list[Path] = []
        for hierarchy in cgroup_hierarchies():
            top = hierarchy / self.top_cgroup.lstrip("/")
            if top.is_dir():
                found += [p for p in top.rglob("*") if p.is_dir()] + [top]
        return sorted(found, key=lambda p: len(p.parts), reverse=True)

    def pod_cgroup(self, pod: dict[str, Any]) -> str:
        """The cgroup kubelet gives a pod of its view, below each hierarchy's root:
        `<root>/kubepods/<qos>/pod<uid>` (guaranteed pods right under `kubepods`), or
        under systemd's driver the slice of those names joined by dashes (the UID's
        dashes escaped as underscores)."""
        qos = pod["status"]["qosClass"]
        classes = [] if qos == "Guaranteed" else [qos.lower()]
        uid = pod["metadata"]["uid"]
        if self.systemd:
            names = [self.node, "kubepods", *classes, f"pod{uid.replace('-', '_')}"]
            return expand_slice("-".join(names) + ".slice")
        return "/".join([self.cgroup_root, "kubepods", *classes, f"pod{uid}"])

    def pod_cgroups(self) -> list[str]:
        """The pod cgroups kubelet made, below the first hierarchy's root (as
        `pod_cgroup` names them)."""
        hierarchy = cgroup_hierarchies()[0]
        pod = re.compile(r"(^|-)pod[0-9a-f_-]+(\.slice)?$")
        return sorted(
            f"/{p.relative_to(hierarchy)}"
            for p in (hierarchy / self.top_cgroup.lstrip("/")).rglob("*pod*")
            if p.is_dir() and pod.search(p.name)
        )

    def remove_cgroups(self) -> list[str]:
        """Remove this kubelet's cgroups once it has stopped; those that cannot be removed
        (something still runs in them) are returned. Under systemd's driver the root slice
        is stopped, which removes them all, once none has a process left (stopping it
        would kill them)."""
        if self.systemd:
            busy = [
                f"{path}: processes {' '.join(procs.split())}"
                for path in self.cgroups()
                if (procs := read_or_empty(path / "cgroup.procs").strip())
            ]
            if busy:
                return busy
            subprocess.run(["systemctl", "stop", self.root_slice], check=False, timeout=120)
        left: list[str] = []
        for path in self.cgroups():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                left.append(f"{path}: {exc.strerror}")
        return left

    def log(self, tail: int | None = 8000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
            return text[-tail:] if tail else text
        except FileNotFoundError:
            return ""

    # ---- its view and its input ---------------------------------------------------

    def get(self, path: str) -> Any:
        url = f"http://127.0.0.1:{self.read_only_port}{path}"
        return httpx.get(url, timeout=30).raise_for_status().json()

    def pods(self) -> dict[str, dict[str, Any]]:
        """kubelet's pods by name (without the node suffix of static pods)."""
        self.others_seen |= other_kubelets(self.pid)
        suffix = f"-{self.node}"
        return {
            p["metadata"]["name"].removesuffix(suffix): p for p in self.get("/pods")["items"] or []
        }

    def write_pod(self, name: str, containers: list[dict[str, Any]], **spec: Any) -> None:
        manifest = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 2, **spec},
        }
        # Written aside (kubelet skips hidden files) and renamed: never read half-written.
        (self.manifests / f".{name}.json").write_text(json.dumps(manifest))
        (self.manifests / f".{name}.json").rename(self.manifests / f"{name}.json")

    def remove_pod(self, name: str) -> None:
        (self.manifests / f"{name}.json").unlink()

    def manifest_names(self) -> list[str]:
        """The pods kubelet is given: its manifests' names."""
        return sorted(p.stem for p in self.manifests.glob("*.json"))

    def pod_logs(self) -> list[Path]:
        """The pods' log directories kubelet made under /var/log/pods."""
        return sorted(POD_LOGS.glob(f"default_*-{self.node}_*"))

    def remove_logs(self) -> None:
        """The pods' log directories and symlinks kubelet made under /var/log."""
        for directory in self.pod_logs():
            subprocess.run(["rm", "-rf", str(directory)], check=False)
        for link in CONTAINER_LOGS.glob(f"*-{self.node}_default_*"):
            link.unlink(missing_ok=True)


def read_or_empty(path: Path) -> str:
    """A file's text, or "" if it (or the cgroup holding it) has gone meanwhile."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def other_kubelets(mine: int | None) -> set[int]:
    """The kubelet processes on this machine other than `mine`. Each removes the
    /var/log/pods directories of every pod it does not know (its log garbage collection),
    those of this kubelet's pods too."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == mine:
            continue
        try:
            program = (entry / "cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if Path(program.decode(errors="replace")).name == "kubelet":
            found.add(int(entry.name))
    return found


# ---- kubelet's view, read ---------------------------------------------------------


def containers_of(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("status", {}).get("containerStatuses", [])}


def running_and_ready(pod: dict[str, Any] | None) -> bool:
    if pod is None or pod.get("status", {}).get("phase") != "Running":
        return False
    statuses = containers_of(pod).values()
    return bool(statuses) and all(c.get("ready") and "running" in c["state"] for c in statuses)


def container_id(status: dict[str, Any]) -> str:
    """kubelet's `cri-shim://<id>` (the runtime's name from Version, then the ID)."""
    return str(status["containerID"]).partition("://")[2]


# ---- what kubelet's garbage collector would do --------------------------------------


def remove_all_sandboxes(runtime: Any, timeout: float = 120) -> None:
    """Stop and remove every sandbox the runtime holds (`runtime`: a RuntimeService stub),
    what kubelet's garbage collector would have done in its own time. A sandbox that is
    gone by the time it is stopped or removed (NOT_FOUND: containerd 1.6 lists one that it
    is removing on its own) is passed over, not left with the rest behind it."""
    for sandbox in runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items:
        try:
            runtime.StopPodSandbox(
                api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout
            )
            runtime.RemovePodSandbox(
                api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
