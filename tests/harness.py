"""Test harness: the real daemon on a temporary socket and state root, and a test network.

Integration and scenario tests start `cri-shim serve` as a subprocess (exactly what an
operator runs), talk gRPC to it like kubelet does, and inspect the host afterwards for
anything left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cri_shim.api.v1 import api_pb2, api_pb2_grpc
from cri_shim.runtime import gvisor
from tests.waiting import wait_until as wait_until  # for the daemon tests

REPO = Path(__file__).resolve().parent.parent
FIXTURE_CNI_BIN = REPO / "tests" / "fixtures" / "cni"
BUSYBOX_IMAGE = "docker.io/library/busybox:latest"
# How long a started daemon may take to serve. An emulated guest (scripts/guest) imports
# and restores several times slower than a host: its lane raises it.
START_TIMEOUT = float(os.environ.get("CRI_SHIM_TEST_START_TIMEOUT", "30"))


def import_command(config: Path, layout: Path, name: str | None = None) -> list[str]:
    """The `cri-shim images import` command line for `layout`, to run from REPO."""
    command = [sys.executable, "-m", "cri_shim.cli", "images", "import"]
    command += ["--config", str(config), str(layout)]
    if name is not None:
        command += ["--name", name]
    return command


def import_image(daemon: Daemon, layout: Path, name: str = BUSYBOX_IMAGE) -> None:
    """`cri-shim images import` into a daemon's store, as an operator of an offline node
    does; the running daemon sees the image at once."""
    subprocess.run(
        import_command(daemon.config_path, layout, name),
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )


def host_local_allocations(ipam_dir: Path, network: str) -> list[str]:
    """IPs host-local still holds for `network` (its files named after addresses)."""
    net_dir = ipam_dir / network
    if not net_dir.exists():
        return []
    return sorted(p.name for p in net_dir.iterdir() if p.name[0].isdigit())


def bridge_veths(bridge: str) -> list[str]:
    """The interfaces attached to `bridge` (the host ends of the pods' veths)."""
    out = subprocess.run(
        ["ip", "-o", "link", "show", "master", bridge],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line]


@dataclass
class CniTestNetwork:
    """A CNI configuration on a bridge of the test's own, with host-local IPAM in tmp."""

    config_dir: Path
    bridge: str
    subnet: str
    ipam_dir: Path
    control_dir: Path

    @property
    def delay_file(self) -> Path:
        return self.control_dir / "delay"

    @property
    def fail_file(self) -> Path:
        return self.control_dir / "fail"

    @property
    def count_file(self) -> Path:
        return self.control_dir / "count"

    @property
    def hold_file(self) -> Path:
        return self.control_dir / "hold"

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Every ADD of the slow plugin waits until the block ends (or the test does):
        the network step lasts exactly as long as the test needs, whatever the machine's
        speed."""
        self.hold_file.touch()
        try:
            yield
        finally:
            self.hold_file.unlink(missing_ok=True)

    def adds(self) -> int:
        if not self.count_file.exists():
            return 0
        return sum(1 for line in self.count_file.read_text().splitlines() if line.startswith("ADD"))

    def allocations(self) -> list[str]:
        """IPs host-local still holds (its files named after addresses)."""
        return host_local_allocations(self.ipam_dir, "crishim-test")

    def veths(self) -> list[str]:
        return bridge_veths(self.bridge)

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)


def _free_subnet(octet: int, third: int) -> str:
    """10.<octet>.<third>.0/24, or the next octet whose subnet no route on the host uses: a
    bridge left by a test run that was killed keeps its route, and a pod on a new bridge
    with the same subnet would be unreachable ("no route to host")."""
    routes = subprocess.run(
        ["ip", "-o", "-4", "route", "show"], capture_output=True, text=True, check=False
    ).stdout
    taken = {line.split()[0] for line in routes.splitlines() if line}
    for step in range(100):
        subnet = f"10.{100 + (octet - 100 + step) % 100}.{third}.0/24"
        if subnet not in taken:
            return subnet
    return f"10.{octet}.{third}.0/24"


def make_test_network(base: Path, index: int, *, slow: bool = True) -> CniTestNetwork:
    config_dir = base / "net.d"
    control = base / "cni-control"
    ipam_dir = base / "ipam"
    for d in (config_dir, control, ipam_dir):
        d.mkdir(parents=True, exist_ok=True)
    bridge = f"crist{os.getpid() % 10000}{index}"[:15]
    subnet = _free_subnet(100 + (os.getpid() + index) % 100, index % 250)
    plugins: list[dict[str, Any]] = [
        {
            "type": "bridge",
            "bridge": bridge,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": subnet}]],
                "dataDir": str(ipam_dir),
            },
        },
        {"type": "portmap", "capabilities": {"portMappings": True}, "snat": True},
    ]
    if slow:
        plugins.append(
            {
                "type": "slow-cni",
                "delayFile": str(control / "delay"),
                "failFile": str(control / "fail"),
                "countFile": str(control / "count"),
                "holdFile": str(control / "hold"),
            }
        )
    conflist = {"cniVersion": "1.0.0", "name": "crishim-test", "plugins": plugins}
    (config_dir / "10-test.conflist").write_text(json.dumps(conflist, indent=2))
    return CniTestNetwork(config_dir, bridge, subnet, ipam_dir, control)


# The interpreter options of the installed unit (contrib/systemd/cri-shim.service):
# docstrings dropped, code objects without their column tables.
INSTALLED_FLAGS = ["-OO", "-X", "no_debug_ranges"]


def socket_activation(fds: tuple[int, ...]) -> list[str]:
    """A command prefix that passes `fds` as systemd does: from descriptor 3 on, with
    LISTEN_PID naming the process that then execs the daemon (the shell itself)."""
    if not fds:
        return []
    moves = " ".join(
        f"{3 + index}<&{fd} {fd}<&-" for index, fd in enumerate(fds) if fd != 3 + index
    )
    names = ":".join("cri-shim.socket" for _ in fds)
    script = (
        f"export LISTEN_PID=$$ LISTEN_FDS={len(fds)} LISTEN_FDNAMES={names}; "
        f'{"exec " + moves + "; " if moves else ""}exec "$@"'
    )
    return ["bash", "-c", script, "bash"]


@dataclass
class Daemon:
    """One `cri-shim serve` process with its own socket, roots and config."""

    base: Path
    network: CniTestNetwork | None
    settings: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # `run_root` when it is not `<base>/run` (the socket stays there: its path is short).
    run_dir: Path | None = None
    # Run before the daemon's command line (which it must exec), e.g. to give the daemon a
    # mount namespace of its own.
    wrapper: list[str] = field(default_factory=list)
    # Python's own options, before `-m` (INSTALLED_FLAGS: as the installed unit runs it).
    interpreter_flags: list[str] = field(default_factory=list)
    # A listening socket handed to the daemon as systemd's socket activation does
    # (descriptor 3, LISTEN_FDS=1, LISTEN_PID the daemon's): the test holds it, as
    # systemd would, across the daemon's restarts.
    pass_fds: tuple[int, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    _channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.base / "run" / "cri-shim.sock"

    @property
    def root(self) -> Path:
        return self.base / "root"

    @property
    def run_root(self) -> Path:
        return self.run_dir or self.base / "run"

    @property
    def config_path(self) -> Path:
        return self.base / "config.toml"

    @property
    def log_path(self) -> Path:
        return self.base / "daemon.log"

    def write_config(self) -> None:
        import tomli_w

        data: dict[str, Any] = {
            "listen": f"unix://{self.socket}",
            "root": str(self.root),
            "run_root": str(self.run_root),
            "log_level": "debug",
        }
        if self.network is not None:
            data["network"] = {
                "config_dir": str(self.network.config_dir),
                "bin_dirs": [str(FIXTURE_CNI_BIN), "/usr/lib/cni"],
            }
        for key, value in self.settings.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
        self.config_path.write_text(tomli_w.dumps(data))

    def start(self, wait: bool = True, timeout: float = START_TIMEOUT) -> None:
        self.write_config()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                *self.wrapper,
                *socket_activation(self.pass_fds),
                sys.executable,
                *self.interpreter_flags,
                "-m",
                "cri_shim.cli",
                "serve",
                "--config",
                str(self.config_path),
            ],
            stdout=log,
            stderr=log,
            env=env,
            cwd=REPO,
            pass_fds=self.pass_fds,
        )
        log.close()
        if wait:
            self.wait_serving(timeout)

    def wait_serving(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    self.runtime().Version(api_pb2.VersionRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"daemon did not serve within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        return self._channel

    def runtime(self) -> api_pb2_grpc.RuntimeServiceStub:
        return api_pb2_grpc.RuntimeServiceStub(self.channel())

    def images(self) -> api_pb2_grpc.ImageServiceStub:
        return api_pb2_grpc.ImageServiceStub(self.channel())

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stop(self, timeout: float = 30.0) -> int:
        self._close_channel()
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill9(self) -> None:
        self._close_channel()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def mountinfo(self) -> list[list[str]]:
        """The daemon's mount table (its own namespace when `wrapper` gave it one), one
        list of fields per mount."""
        pid = self.proc.pid if self.proc is not None and self.proc.poll() is None else "self"
        return [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]

    def status_info(self) -> dict[str, Any]:
        """The daemon's account of itself in Status verbose: its creations' counters and
        what is in flight, its event loop's lag."""
        status = self.runtime().Status(api_pb2.StatusRequest(verbose=True), timeout=30)
        info: dict[str, Any] = json.loads(status.info["info"])
        return info

    def creations(self, kind: str = "sandbox") -> dict[str, Any]:
        """Status verbose's `creation` figures of `kind` (sandbox or container)."""
        figures: dict[str, Any] = self.status_info()["creation"][kind]
        return figures

    def rows(self, table: str, where: str = "1") -> list[sqlite3.Row]:
        conn = sqlite3.connect(self.root / "state.db")
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute(f"SELECT * FROM {table} WHERE {where}").fetchall()
        finally:
            conn.close()

    def runc_containers(self) -> list[str]:
        """The containers runc still knows under the daemon's default handler."""
        listed = subprocess.run(
            ["runc", "--root", str(self.run_root / "runtime" / "runc"), "list", "-q"],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
        return listed.stdout.split()

    def leaks(self) -> dict[str, list[str]]:
        """Everything a daemon with no objects must not hold any more."""
        found: dict[str, list[str]] = {}
        pin_dirs = ("netns", "utsns", "ipcns", "userns")
        for kind in pin_dirs:
            d = self.run_root / kind
            if d.exists() and (pins := sorted(p.name for p in d.iterdir())):
                found[kind] = pins
        mounts = [
            fields[4]
            for fields in self.mountinfo()
            if fields[4].startswith((str(self.root), str(self.run_root)))
            and fields[4] not in (str(self.run_root / k) for k in pin_dirs)
        ]
        if mounts:
            found["mounts"] = mounts
        for table in ("sandboxes", "containers", "names", "journal", "allocations", "gc_queue"):
            if (self.root / "state.db").exists() and (rows := self.rows(table)):
                found[table] = [str(tuple(r)) for r in rows][:5]
        if self.network is not None:
            if allocations := self.network.allocations():
                found["ipam"] = allocations
            if veths := self.network.veths():
                found["veths"] = veths
        sandboxes = self.root / "sandboxes"
        if sandboxes.exists() and (dirs := sorted(p.name for p in sandboxes.iterdir())):
            found["sandbox_dirs"] = dirs
        return found


def conmon_of(daemon: Daemon, object_id: str) -> int:
    """The pid of the conmon of a container (or of a pod's pause container), from the
    daemon's own record of it (meta.json, with its start time), checked against /proc:
    never a conmon of anyone else."""
    (meta_path,) = [
        p
        for base in (daemon.root, daemon.run_root)
        for p in base.rglob(f"containers/{object_id}/meta.json")
    ]
    meta = json.loads(meta_path.read_text())
    pid, start_time = int(meta["conmon_pid"]), int(meta["conmon_start_time"])
    stat = Path(f"/proc/{pid}/stat").read_text()
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "conmon"
    assert int(stat.rpartition(")")[2].split()[19]) == start_time, "conmon's pid was reused"
    return pid


OBJECT_ID = re.compile(r"\b[0-9a-f]{64}\b")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def ids_named(log: str) -> set[str]:
    """The object IDs a daemon's log names, but those it only answered NOT_FOUND for: a
    kubelet asks its runtime about every cri-shim-<id> cgroup its cAdvisor sees on the
    host, another daemon's too."""
    return {
        found
        for line in log.splitlines()
        if "NOT_FOUND" not in line
        for found in OBJECT_ID.findall(line)
    }


def runtime_leaks(daemon: Daemon) -> dict[str, list[str]]:
    """What the runtime side of a daemon with no objects must not hold any more, beyond
    `Daemon.leaks`: container directories, each handler's runtime state, conmon's files,
    processes given the daemon's roots in their arguments (conmon, runc), and the
    cgroups of the pods and containers it made (every ID its log names: the cgroup tree
    is the host's, shared with other runtimes)."""
    found: dict[str, list[str]] = {}
    containers = daemon.root / "containers"
    if containers.exists() and (dirs := sorted(p.name for p in containers.iterdir())):
        found["container_dirs"] = dirs
    # runc's (crun's) state: a directory per container, under each handler's root.
    runtimes = daemon.run_root / "runtime"
    if runtimes.exists() and (
        state := sorted(str(p.relative_to(runtimes)) for p in runtimes.glob("*/*"))
    ):
        found["runtime_state"] = state
    # conmon's pid, exit and attach files, under each handler's directory (a gVisor
    # handler's script conmon runs is the handler's, written at each start).
    monitors = daemon.run_root / "conmon"
    if monitors.exists() and (
        files := sorted(
            str(p.relative_to(monitors))
            for p in monitors.rglob("*")
            if not p.is_dir() and p.relative_to(monitors).parts[1:] != (gvisor.SCRIPT_NAME,)
        )
    ):
        found["conmon_files"] = files
    roots = (str(daemon.root), str(daemon.run_root))
    processes = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone while looking
        if any(root in arg.decode(errors="replace") for arg in argv for root in roots):
            processes.append(f"{proc.name}: {b' '.join(argv).decode(errors='replace')[:200]}")
    if processes:
        found["processes"] = processes
    ids = ids_named(daemon.log_path.read_text(errors="replace"))
    cgroups = [
        os.path.join(directory, name)
        for directory, subdirs, _ in os.walk(CGROUP_ROOT)
        for name in subdirs
        # cgroupfs: cri-shim-<id>; systemd: cri-shim-<id>.scope, cri-shim-conmon-<id>.scope
        if name.removeprefix("cri-shim-").removeprefix("conmon-").removesuffix(".scope") in ids
    ]
    if cgroups:
        found["cgroups"] = sorted(set(cgroups))
    return found


def pod_config(
    name: str = "pod",
    namespace: str = "default",
    uid: str = "uid-1",
    attempt: int = 0,
    **kwargs: Any,
) -> api_pb2.PodSandboxConfig:
    return api_pb2.PodSandboxConfig(
        metadata=api_pb2.PodSandboxMetadata(
            name=name, namespace=namespace, uid=uid, attempt=attempt
        ),
        hostname=kwargs.pop("hostname", name),
        log_directory=kwargs.pop("log_directory", ""),
        labels=kwargs.pop("labels", {"app": name}),
        annotations=kwargs.pop("annotations", {"note": "test"}),
        linux=kwargs.pop("linux", api_pb2.LinuxPodSandboxConfig()),
        **kwargs,
    )


def ping(ip: str) -> bool:
    return (
        subprocess.run(
            ["ping", "-c", "1", "-W", "2", ip], capture_output=True, check=False
        ).returncode
        == 0
    )


def identical_requests(call: Callable[[], str], times: int) -> list[str | grpc.StatusCode]:
    """Send the same creation `times` times at once; each answer's ID or status code."""
    with concurrent.futures.ThreadPoolExecutor(times) as pool:
        futures = [pool.submit(call) for _ in range(times)]
        results: list[str | grpc.StatusCode] = []
        for future in futures:
            try:
                results.append(future.result())
            except grpc.RpcError as exc:
                results.append(exc.code())
    return results


def refused_as_reserved(call: Callable[[], object], tries: int = 10) -> tuple[grpc.RpcError, int]:
    """The `name is reserved` a duplicate request gets at its deadline while the creation
    it waits on is held, and how many tries that took. The daemon answers a little before
    the client's deadline; on a busy machine the client's own deadline can fire first,
    and then, as kubelet does, the request is simply sent again."""
    for attempt in range(1, tries + 1):
        try:
            call()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return exc, attempt
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        else:
            raise AssertionError("a duplicate was answered while its creation was held")
    raise AssertionError(f"no `name is reserved` in {tries} tries")


def assert_one_created(results: list[str | grpc.StatusCode]) -> None:
    """One object for all; any request not given its ID was told `name is reserved`."""
    assert len({r for r in results if isinstance(r, str)}) == 1, results
    assert all(r == grpc.StatusCode.ALREADY_EXISTS for r in results if not isinstance(r, str))


def userns_linux(
    host_id: int, length: int = 65536, pid: int = api_pb2.CONTAINER, **namespaces: int
) -> api_pb2.LinuxPodSandboxConfig:
    """A pod's Linux config asking for a user namespace of its own (hostUsers: false), as
    kubelet sends it: container ids 0..length mapped to host_id.., PID not shared."""
    mapping = [api_pb2.IDMapping(host_id=host_id, container_id=0, length=length)]
    options = api_pb2.NamespaceOption(
        userns_options=api_pb2.UserNamespace(mode=api_pb2.POD, uids=mapping, gids=mapping),
        pid=pid,
        **namespaces,
    )
    return api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(namespace_options=options)
    )
