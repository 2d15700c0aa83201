"""Containers run under conmon, as CRI-O runs them: one RuntimeBackend per runtime handler.

RuntimeBackend is the one object the lifecycle holds per handler; each concern it answers
for is a module of its own, as containerd keeps its task service, process handling and
runtime client apart:

    container_files.py   the files under `state_dir`, which are all a restart needs
    handler_runtime.py   what the parts share: the runtime's command line and kind, the
                         files, conmon's scopes, the host's cgroups; deletion in the runtime
    create.py            create (conmon launched by conmon_launch.py) and start
    stop.py              the stop signal, the grace period, SIGKILL
    delete.py            delete, and the undoing of a failed create
    exits.py             exit files, waiting for an exit, states, OOM kills
    conmon_watch.py      conmon and OOM watches, a dead conmon's container ended, adoption
                         after a restart
    exec_sync.py         ExecSync through `<runtime> exec`
    log_reopen.py        the log reopened after kubelet's rotation
    kinds/               where a container's limits go (kinds/base.py: the runtime's
                         `update`; kinds/gvisor.py: the pod's cgroup, summed)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import NotFound
from cri_shim.runtime import exec_sync, log_reopen
from cri_shim.runtime.cgroup_driver import cgroup_dir
from cri_shim.runtime.cgroup_layout import CgroupLayout
from cri_shim.runtime.conmon_launch import ConmonLauncher
from cri_shim.runtime.conmon_scope import ConmonScopes
from cri_shim.runtime.conmon_watch import ConmonWatch
from cri_shim.runtime.container_files import ContainerFiles
from cri_shim.runtime.create import ContainerCreate
from cri_shim.runtime.delete import ContainerDelete
from cri_shim.runtime.exits import ContainerExits
from cri_shim.runtime.handler_runtime import HandlerRuntime, executable
from cri_shim.runtime.host_limits import HostLimits
from cri_shim.runtime.kinds.base import HandlerKind
from cri_shim.runtime.kinds.probe import kind_of
from cri_shim.runtime.monitors import MonitorWatch
from cri_shim.runtime.oci import CallObserver, ExecResult, OciRuntime
from cri_shim.runtime.oom_watch import OomWatch
from cri_shim.runtime.resources import linux_resources
from cri_shim.runtime.stop import ContainerStop

CREATE_TIMEOUT = 60.0  # conmon + runc create; a large rootfs or a busy host is slow


class RuntimeBackend:
    """Create, start, stop, delete and inspect containers of one runtime handler."""

    def __init__(
        self,
        handler_name: str,
        runtime_path: Path,
        runtime_root: Path,
        conmon_path: Path,
        state_dir: Path,
        *,
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        host: HostLimits | None = None,
        call_timeout: float = 30.0,
        create_timeout: float = CREATE_TIMEOUT,
        conmon_log_level: str = "info",
        runtime_args: Sequence[str] = (),
        observe_call: CallObserver | None = None,
        monitors: MonitorWatch | None = None,
        scopes: ConmonScopes | None = None,
        kind: HandlerKind | None = None,
        pod_sandbox: bool | None = None,
        oom_watch: OomWatch | None = None,
    ) -> None:
        self.handler_name = handler_name
        self.runtime_path = executable(runtime_path, "runtime")
        # What differs with the runtime (runtime/kinds/): probed once per binary if not given.
        self.kind = kind or kind_of(self.runtime_path)
        # Whether pods get a sandbox container their containers join: the configuration's
        # `pod_sandbox`, else the kind's.
        self.pod_sandbox = self.kind.pod_sandbox if pod_sandbox is None else pod_sandbox
        self.conmon_path = executable(conmon_path, "conmon")
        self.state_dir = state_dir
        self.cgroup_root = cgroup_root
        files = ContainerFiles(state_dir)
        for directory in (files.exits, files.sockets, files.containers, runtime_root):
            directory.mkdir(parents=True, exist_ok=True)
        self.oci = OciRuntime(
            self.runtime_path,
            runtime_root,
            log_dir=state_dir / "runc-logs",
            call_timeout=call_timeout,
            extra_args=runtime_args,
            observe_call=observe_call,
        )
        self.oci.log_dir.mkdir(parents=True, exist_ok=True)
        self._runtime = HandlerRuntime(
            handler_name, self.kind, self.oci, files, cgroup_root, host, scopes
        )
        # What conmon runs (gVisor's containers need a process it can wait for).
        self.conmon_runtime = self.kind.conmon_runtime(state_dir, handler_name)
        self._exits = ContainerExits(self._runtime, oom_watch)
        self._watch = ConmonWatch(self._runtime, self._exits, monitors, oom_watch)
        # Where a running container's limits go: the kind's.
        self._limits = self.kind.limits(self._runtime)
        self._delete = ContainerDelete(self._runtime, self._watch, self._limits)
        launcher = ConmonLauncher(
            self._runtime, self.conmon_path, self.conmon_runtime, create_timeout, conmon_log_level
        )
        self._create = ContainerCreate(
            self._runtime, launcher, self._watch, self._limits, self._delete
        )
        self._stop = ContainerStop(self._runtime, self._exits)

    @property
    def exits_dir(self) -> Path:
        """Where conmon writes `<id>` with the exit code when a container exits."""
        return self._runtime.files.exits

    @property
    def mounts_at_start(self) -> bool:
        """Whether the runtime makes a container's mounts when it starts it rather than
        when it creates it, so that the bind-mount sources staged for it must stay until
        its bundle goes."""
        return self.kind.mounts_at_start

    @property
    def cgroup_layout(self) -> CgroupLayout:
        """The host's cgroup layout (v1 or v2), through which its cgroups are read."""
        return self._runtime.cgroup_layout

    # ---- the container's life: create.py, stop.py, delete.py ---------------------------

    async def create(
        self,
        container_id: str,
        bundle: Path,
        spec: Mapping[str, Any],
        log_path: Path,
        tty: bool,
        stdin: bool,
        stdin_once: bool = True,
    ) -> int:
        """The container created under conmon; its pid (create.py)."""
        return await self._create.create(
            container_id, bundle, spec, log_path, tty, stdin, stdin_once
        )

    async def start(self, container_id: str) -> None:
        await self._create.start(container_id)

    async def stop(self, container_id: str, timeout: float, stop_signal: int) -> None:
        """The stop signal, `timeout` seconds, then SIGKILL (stop.py)."""
        await self._stop.stop(container_id, timeout, stop_signal)

    async def delete(self, container_id: str) -> None:
        """The container out of the runtime, its conmon and files gone (delete.py)."""
        await self._delete.delete(container_id)

    # ---- its monitor: conmon_watch.py ---------------------------------------------------

    async def end_unmonitored(self, container_id: str) -> None:
        await self._watch.end_unmonitored(container_id)

    def monitor_died(self, container_id: str) -> bool:
        return self._watch.monitor_died(container_id)

    def monitor_gone(self, container_id: str) -> bool:
        return self._exits.monitor_gone(container_id)

    async def adopt(self, states: Mapping[str, str]) -> list[str]:
        return await self._watch.adopt(states)

    # ---- its exit and state: exits.py ---------------------------------------------------

    def recorded_exits(self) -> set[str]:
        return self._exits.recorded_exits()

    def exit_status(self, container_id: str) -> tuple[int, int] | None:
        return self._exits.exit_status(container_id)

    async def wait_exit(self, container_id: str, timeout: float | None) -> tuple[int, int]:
        return await self._exits.wait_exit(container_id, timeout)

    async def state(self, container_id: str) -> str:
        return await self._exits.state(container_id)

    async def states(self) -> dict[str, str]:
        return await self._exits.states()

    def unlisted_state(self, container_id: str) -> str:
        return self._exits.unlisted_state(container_id)

    def oom_killed(self, container_id: str) -> bool:
        return self._exits.oom_killed(container_id)

    # ---- where it lives ----------------------------------------------------------------

    def cgroups_path(self, container_id: str) -> str | None:
        """The container's cgroup, relative to each hierarchy's root (its spec's
        cgroupsPath, a systemd one resolved to its scope's directory)."""
        meta = self._runtime.files.read_meta(container_id)
        return (cgroup_dir(meta.cgroups_path) or None) if meta is not None else None

    def attach_socket(self, container_id: str) -> Path:
        """conmon's attach socket for the container: `attach` in its bundle. The path may
        exceed the 108 bytes of a unix socket address; connect through the directory."""
        meta = self._runtime.files.read_meta(container_id)
        if meta is None:
            raise NotFound(f"container {container_id} has no monitor")
        return Path(meta.bundle) / "attach"

    # ---- exec, logs, resources ---------------------------------------------------------

    async def exec_sync(
        self,
        container_id: str,
        cmd: Sequence[str],
        timeout: float | None,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        return await exec_sync.exec_sync(self._runtime, container_id, cmd, timeout, env)

    def exec_options(self, container_id: str) -> list[str]:
        return exec_sync.exec_options(self._runtime, container_id)

    async def reopen_log(self, container_id: str) -> None:
        await log_reopen.reopen_log(self._runtime, container_id)

    async def update_resources(
        self,
        container_id: str,
        resources: api_pb2.LinuxContainerResources | Mapping[str, Any],
    ) -> None:
        """New limits of a running container, where its kind applies them."""
        if isinstance(resources, api_pb2.LinuxContainerResources):
            oci_resources = linux_resources(resources, self._runtime.host_limits())
        else:
            oci_resources = dict(resources)
        if not oci_resources:
            return
        await self._limits.update(container_id, oci_resources)
