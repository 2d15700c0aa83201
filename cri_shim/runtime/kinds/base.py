"""A runtime handler's kind: the one object that knows how its runtime differs from a
runc-like OCI runtime (runc, crun, youki), which this class is.

Everything that depends on what the runtime is goes through the kind: whether a pod gets
a sandbox container its containers join and how that container's spec is made, how a
container joins the pod's PID namespace, what conmon runs, how a container is started,
signalled before its start, deleted and updated (where a running container's limits go:
ContainerLimits), the options of `exec` and its terminal,
whether a process runs inside the runtime's own kernel (and how it is killed there), port
forwarding into the pod, and the features Status advertises. A kind is decided once per
runtime binary (probe.py); a new kind is a subclass in this package with its tests, and
nothing outside the package branches on a runtime's name or path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError
from cri_shim.runtime.container_files import ContainerFiles
from cri_shim.runtime.features import HandlerFeatures, probe_features
from cri_shim.runtime.host_limits import HostLimits

# How a runtime that runs a pod as one sandbox tells the pod's sandbox container from the
# containers that join it (`sandbox`, `container`), and which sandbox they join.
CONTAINER_TYPE = "io.kubernetes.cri.container-type"
SANDBOX_ID = "io.kubernetes.cri.sandbox-id"


class OciCommands(Protocol):
    """What a kind asks of the runtime's command line (runtime/oci.py's OciRuntime)."""

    root: Path

    async def delete(self, container_id: str, *, force: bool = False) -> None: ...

    async def update(self, container_id: str, resources: Mapping[str, Any]) -> None: ...


class KindContext(Protocol):
    """What a kind's parts may read of the handler they serve (runtime/handler_runtime.py's
    HandlerRuntime)."""

    handler_name: str
    files: ContainerFiles
    cgroup_root: Path

    @property
    def oci(self) -> OciCommands: ...

    def host_limits(self) -> HostLimits: ...


class ContainerLimits:
    """Where a container's limits go: the runtime applies them, at its create and with
    its `update`."""

    def __init__(self, handler: KindContext) -> None:
        self._handler = handler

    async def created(self, spec: Mapping[str, Any]) -> None:
        """A container was created with the limits of `spec`."""

    async def update(self, container_id: str, resources: Mapping[str, Any]) -> None:
        """New limits (OCI `linux.resources` fields) of a running container."""
        await self._handler.oci.update(container_id, resources)

    def forget(self, container_id: str) -> None:
        """A container was deleted."""


# Kills a process and its descendants by their pids in the runtime's own kernel:
# (the runtime's command line before the subcommand, container ID, pid there, budget).
KillInside = Callable[[Sequence[str], str, int, float], None]


class HandlerKind:
    """An OCI runtime driven by its command line, whose containers are host processes."""

    # What runs the pod, in messages ("runtime handler 'x' (gVisor kernel gives no ...)").
    engine = "runtime"
    # Whether pods get a sandbox container their containers join (overridden by
    # `[runtime.handlers.NAME] pod_sandbox`).
    pod_sandbox = False
    # Whether the runtime makes a container's mounts when it starts it rather than when
    # it creates it, so the bind-mount sources staged for it must stay until its bundle goes.
    mounts_at_start = False
    # Whether a container whose spec names no PID namespace is put in its sandbox's own
    # (where the sandbox container is PID 1), so a pod sharing one names none.
    pid_namespace_of_sandbox = False
    # How `<runtime> exec --detach` is told to give the command a terminal (beside the
    # console socket).
    tty_options: tuple[str, ...] = ("--tty",)

    def __init__(self, runtime_path: Path) -> None:
        self.runtime_path = runtime_path

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.runtime_path)!r})"

    def features(self) -> HandlerFeatures:
        """What the handler supports: `<runtime> features`, asked once, then remembered."""
        return probe_features(self.runtime_path)

    @property
    def inside(self) -> KillInside | None:
        """How a process in the runtime's own kernel is killed; None where the
        container's processes are host processes, which a host signal reaches."""
        return None

    def conmon_runtime(self, state_dir: Path, handler: str) -> Path:
        """What conmon runs as the runtime of `handler`."""
        return self.runtime_path

    def prepare_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The spec the runtime is given (`spec` is the caller's: copy before changing)."""
        return spec

    def prepare_pod_sandbox(
        self, spec: dict[str, Any], rootfs: Path, pod: api_pb2.PodSandboxConfig
    ) -> None:
        """Add to a pod's sandbox container what the kind needs in it."""

    def start_refused(self, handler: str, err: CriError) -> CriError | None:
        """An error a person can act on for a pod sandbox the runtime refused to start,
        or None to raise the runtime's own."""
        return None

    def start_env(self, bundle: Path) -> Mapping[str, str]:
        """Environment of the `start` of the container in `bundle`, run through conmon's
        runtime; empty: the runtime's own `start`."""
        return {}

    def end_unstarted(self, bundle: Path, err: CriError) -> bool:
        """End a container the runtime could not signal (`err`) because it is not started;
        False where that is not why."""
        return False

    async def delete(self, oci: OciCommands, container_id: str, bundle: Path | None) -> None:
        """`<runtime> delete --force`, and whatever the runtime leaves behind."""
        await oci.delete(container_id, force=True)

    def limits(self, handler: KindContext) -> ContainerLimits:
        """Where the limits of `handler`'s containers go."""
        return ContainerLimits(handler)

    def exec_options(self, bundle: Path) -> list[str]:
        """Options of `<runtime> exec` that make the process the container's."""
        return []

    def check_port_forward(self, handler: str, runtime_args: Sequence[str]) -> None:
        """Refuse port-forward into a pod of `handler` where a dial cannot reach it."""

    def relay_argv(
        self, root: Path, runtime_args: Sequence[str], sandbox_id: str, port: int
    ) -> list[str] | None:
        """A command whose stdio is a connection to the pod's port, run where the dial
        from the node's side of the namespace does not arrive; None: dial directly."""
        return None
