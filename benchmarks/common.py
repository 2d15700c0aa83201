"""Shared pieces of the benchmarks: a daemon on a scratch root and a test network."""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cri_shim.api.v1 import api_pb2
from tests.churn import IMAGE
from tests.harness import INSTALLED_FLAGS, REPO, Daemon, make_test_network, pod_config


def activation_socket(path: Path) -> socket.socket:
    """A listening socket at `path`, to hand a daemon as systemd's socket activation does
    (`Daemon(..., pass_fds=(held.fileno(),))`): its calls then pass through the relay."""
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.bind(str(path))
    held.listen(socket.SOMAXCONN)
    return held


# An installed daemon loads its modules' bytecode; one that compiles them at every start,
# as under PYTHONDONTWRITEBYTECODE=1, keeps ~1.7 MiB more of the compiler's leftovers on
# its heap. The benchmarks' bytecode is cached where git ignores it.
BYTECODE = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(REPO / ".cache" / "pycache")}


def compile_as_installed() -> None:
    """The daemon's and its dependencies' bytecode, compiled under the unit's options as
    scripts/install compiles it, so that the daemon loads it rather than compiling."""
    paths = [str(REPO / "cri_shim"), *(p for p in sys.path if p.endswith("site-packages"))]
    subprocess.run(
        [sys.executable, *INSTALLED_FLAGS, "-m", "compileall", "-q", "-j0", *paths],
        env=dict(os.environ, **BYTECODE),
        stdout=subprocess.DEVNULL,
        check=False,  # a file that does not compile (a test fixture) is left to the import
    )


@contextmanager
def bench_daemon(
    settings: dict[str, Any] | None = None,
    slow_cni: bool = True,
    env: dict[str, str] | None = None,
    interpreter_flags: list[str] | None = None,
) -> Iterator[Daemon]:
    base = Path(tempfile.mkdtemp(prefix="csb-", dir="/tmp"))
    base.chmod(0o711)  # reachable from a pod's user namespace, as /var/lib is
    network = make_test_network(base, 7, slow=slow_cni)
    daemon = Daemon(
        base,
        network,
        settings=settings or {},
        env=env or {},
        interpreter_flags=interpreter_flags or [],
    )
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        network.remove()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            if line.split()[4].startswith(str(base)):
                subprocess.run(["umount", "-l", line.split()[4]], check=False)
        shutil.rmtree(base, ignore_errors=True)


def _status_mib(pid: int, *keys: str) -> list[float]:
    """Those /proc/PID/status fields (kB) in MiB, 0 for one that is missing."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            found[key] = int(value.split()[0]) / 1024
    return [found.get(key, 0.0) for key in keys]


def rss_mib(pid: int) -> float:
    return _status_mib(pid, "VmRSS")[0]


def rss_split_mib(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB. The file-backed part is shared libraries'
    pages, and with the kernel's fault-around it grows with what the page cache holds
    of them: it moves by half a MiB between runs that the daemon cannot tell apart."""
    anon, file = _status_mib(pid, "RssAnon", "RssFile")
    return anon, file


def thread_cpu_seconds(task: Path) -> float | None:
    """The CPU time one thread (`/proc/PID/task/TID`) has run (the scheduler's, in ns);
    None for a thread that ended while we looked."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_seconds(pid: int) -> float:
    """The CPU time all of the process's threads have run (the scheduler's, in ns)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sum(seconds for task in tasks if (seconds := thread_cpu_seconds(task)) is not None)


def percentiles(samples: list[float], high: float = 0.95) -> tuple[float, float]:
    """The median and the `high` quantile (nearest rank) of `samples`."""
    ordered = sorted(samples)
    upper = ordered[min(len(ordered) - 1, round(high * (len(ordered) - 1)))]
    return statistics.median(ordered), upper


def row(name: str, samples: list[float]) -> str:
    median, p95 = percentiles(samples)
    return (
        f"{name:<22} median {median * 1000:8.1f} ms   p95 {p95 * 1000:8.1f} ms   (n={len(samples)})"
    )


def sleeping_container(log_path: str = "") -> api_pb2.ContainerConfig:
    """A busybox container named `c` that sleeps for an hour."""
    return api_pb2.ContainerConfig(
        metadata=api_pb2.ContainerMetadata(name="c"),
        image=api_pb2.ImageSpec(image=IMAGE),
        command=["sleep", "3600"],
        log_path=log_path,
    )


def pod_with_container(daemon: Daemon, name: str) -> str:
    """A pod running one sleeping busybox container; the pod's sandbox ID."""
    rt = daemon.runtime()
    config = pod_config(name, uid=name)
    sandbox_id = rt.RunPodSandbox(
        api_pb2.RunPodSandboxRequest(config=config), timeout=60
    ).pod_sandbox_id
    container_id = rt.CreateContainer(
        api_pb2.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, sandbox_config=config, config=sleeping_container()
        ),
        timeout=60,
    ).container_id
    rt.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=60)
    return str(sandbox_id)


def run_critest_benchmark(
    critest: Path, endpoint: str, work: Path, log: Path, args: list[str], *, append: bool = False
) -> int:
    """critest's `-benchmark` against `endpoint` from `work` (its temporary files there
    too), its output into `log`; critest's exit status. `args` are critest's further
    arguments (a focus, the parameters file, the output directory)."""
    command = [
        str(critest),
        "-benchmark",
        f"--runtime-endpoint={endpoint}",
        f"--image-endpoint={endpoint}",
        "--ginkgo.no-color",
        *args,
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as sink:
        return subprocess.run(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=dict(os.environ, TMPDIR=str(work)),
            check=False,
        ).returncode
