"""A node for end-to-end runs: the real kubelet, standalone, with kubelet's own defaults
(`--cgroups-per-qos=true --enforce-node-allocatable=pods`), against a CRI runtime.

Shared by the density benchmark and the soak scenario. kubelet's cgroups go under a cgroup
root of the node's own (`/<node>`): kubelet removes every pod cgroup under its root that
it does not know of, killing what runs there, so two kubelets on one machine must never
share `/kubepods`. The root is made in every cgroup v1 hierarchy before kubelet starts (it
refuses a root that does not exist) and removed, with what kubelet made below it, after.

Also here: how much CPU the runtime side uses (a cpuacct cgroup that the runtime's daemon
is moved into, so that every helper it starts and every child it reaps is counted, and
nothing else), and its proportional set size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from cri_shim.host.mounts import mount_points, unmount_below
from tests.harness import REPO, wait_until
from tests.registry import free_port

KUBELET = REPO.parent / "shared" / "kubelet" / "kubelet"
POD_LOGS = Path("/var/log/pods")  # kubelet's, fixed: this build takes no --config
CONTAINER_LOGS = Path("/var/log/containers")
CGROUP_FS = Path("/sys/fs/cgroup")
# A container that stops at once on SIGTERM (a shell as PID 1 ignores it otherwise).
LOOP = "trap 'exit 0' TERM; while true; do sleep 1; done"


def cgroup_v1_hierarchies() -> list[Path]:
    """The mount points of the cgroup v1 hierarchies (`cpu`, `memory`, `name=systemd`…)."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup":
            found.append(Path(fields[1]))
    return found


@dataclass
class CgroupRoot:
    """`/<name>` in every cgroup v1 hierarchy: kubelet's --cgroup-root."""

    name: str

    @property
    def path(self) -> str:
        return f"/{self.name}"

    def create(self) -> None:
        for hierarchy in cgroup_v1_hierarchies():
            directory = hierarchy / self.name
            directory.mkdir(exist_ok=True)
            if (hierarchy / "cpuset.cpus").exists():
                # A new cpuset is empty: nothing could run in it or below it.
                for key in ("cpuset.cpus", "cpuset.mems"):
                    (directory / key).write_text((hierarchy / key).read_text())

    def remove(self) -> list[str]:
        """Remove the root and everything kubelet made below it; what could not be."""
        left = []
        for hierarchy in cgroup_v1_hierarchies():
            top = hierarchy / self.name
            if not top.exists():
                continue
            for directory, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                try:
                    os.rmdir(directory)
                except OSError as exc:
                    left.append(f"{directory}: {exc.strerror}")
        return left


@dataclass
class Kubelet:
    """One kubelet process, standalone (no API server), with fresh ports on each start."""

    base: Path
    endpoint: str
    node: str
    sync_frequency: str = "10s"
    file_check_frequency: str = "5s"
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    read_only_port: int = 0
    starts: int = 0

    def __post_init__(self) -> None:
        self.cgroups = CgroupRoot(self.node)
        for path in (self.root, self.manifests):
            path.mkdir(parents=True, exist_ok=True)

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

    def command(self) -> list[str]:
        return [
            str(KUBELET),
            f"--container-runtime-endpoint={self.endpoint}",
            f"--image-service-endpoint={self.endpoint}",
            f"--pod-manifest-path={self.manifests}",
            f"--file-check-frequency={self.file_check_frequency}",
            f"--sync-frequency={self.sync_frequency}",
            "--cgroup-driver=cgroupfs",
            "--cgroups-per-qos=true",
            "--enforce-node-allocatable=pods",
            f"--cgroup-root={self.cgroups.path}",
            "--fail-swap-on=false",
            "--fail-cgroupv1=false",
            f"--root-dir={self.root}",
            f"--cert-dir={self.root / 'pki'}",
            f"--hostname-override={self.node}",
            "--register-node=false",
            "--anonymous-auth=true",
            "--authentication-token-webhook=false",
            "--authorization-mode=AlwaysAllow",
            "--address=127.0.0.1",
            f"--port={free_port()}",
            f"--read-only-port={self.read_only_port}",
            "--healthz-bind-address=127.0.0.1",
            f"--healthz-port={free_port()}",
            "--v=2",
            *self.extra_args,
        ]

    def start(self, timeout: float = 60) -> None:
        self.cgroups.create()
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

    def unmount(self) -> None:
        """kubelet bind-mounts its root directory onto itself, once per start."""
        for _ in range(self.starts + 1):
            if not self.mounts():
                return
            unmount_below(self.root)

    def mounts(self) -> list[Path]:
        return [p for p in mount_points() if p == self.root or self.root in p.parents]

    def clean_up(self) -> list[str]:
        """After the pods are gone from the runtime: kubelet stopped, its root unmounted,
        its cgroups and the logs it wrote under /var/log removed. What was left behind."""
        self.stop()
        self.unmount()
        self.remove_logs()
        left = [f"mount {p}" for p in self.mounts()]
        return left + self.cgroups.remove()

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
        return sorted(p.stem for p in self.manifests.glob("*.json"))

    def pod_logs(self) -> list[Path]:
        """The pods' log directories kubelet made under /var/log/pods."""
        return sorted(POD_LOGS.glob(f"default_*-{self.node}_*"))

    def remove_logs(self) -> None:
        for directory in self.pod_logs():
            subprocess.run(["rm", "-rf", str(directory)], check=False)
        for link in CONTAINER_LOGS.glob(f"*-{self.node}_default_*"):
            link.unlink(missing_ok=True)


# ---- kubelet's view, read ---------------------------------------------------------


def containers_of(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("status", {}).get("containerStatuses", [])}


def running_and_ready(pod: dict[str, Any] | None) -> bool:
    if pod is None or pod.get("status", {}).get("phase") != "Running":
        return False
    statuses = containers_of(pod).values()
    return bool(statuses) and all(c.get("ready") and "running" in c["state"] for c in statuses)


# ---- the runtime side's cost -------------------------------------------------------


class CpuAccount:
    """A cpuacct cgroup of its own for the runtime's daemon. Moved in before it starts
    anything, the daemon's helpers (conmon, shims) and the children it reaps (runc, CNI
    plugins) are born in it and their CPU time stays counted there after they exit; a
    container's processes are moved by runc into the container's cgroup and are not."""

    def __init__(self, name: str) -> None:
        self.path = CGROUP_FS / "cpuacct" / name
        self.path.mkdir(exist_ok=True)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def seconds(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        """Processes still in it go back to the root cgroup first."""
        for pid in self.pids():
            try:
                (self.path.parent / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # it exited meanwhile
        try:
            self.path.rmdir()
        except OSError:
            time.sleep(0.5)  # a process that was exiting has just gone
            self.path.rmdir()


def pss_mib(pid: int) -> float:
    """The process's proportional set size: its pages, shared ones divided among sharers."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0.0


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pids: set[int]) -> list[int]:
    """The processes whose parent is one of `pids`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # The command may hold spaces and parentheses: the fields follow the last ')'.
        if int(stat.rpartition(")")[2].split()[1]) in pids:
            found.append(int(entry.name))
    return found


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(its own CPU seconds, those of the children it has reaped), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) / ticks
    reaped = (int(fields[13]) + int(fields[14])) / ticks
    return own, reaped


def remove_all_sandboxes(runtime: Any, timeout: float = 120) -> None:
    """Stop and remove every sandbox the runtime holds (`runtime`: a RuntimeService stub),
    what kubelet's garbage collector would have done in its own time."""
    from cri_shim.api.v1 import api_pb2

    for sandbox in runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items:
        runtime.StopPodSandbox(
            api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout
        )
        runtime.RemovePodSandbox(
            api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=timeout
        )
