"""ExecSync, and where the streaming server reaches a container (Exec, Attach)."""

from __future__ import annotations

import asyncio

from cri_shim.errors import CriError, DeadlineExceeded, FailedPrecondition, InvalidArgument
from cri_shim.lifecycle.container_queries import VisibleContainers
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.runtime.monitors import process_stat
from cri_shim.runtime.oci import ExecResult
from cri_shim.state.containers import RUNNING
from cri_shim.streaming.backend import ContainerEndpoint


class ContainerExec:
    def __init__(self, containers: VisibleContainers, handlers: RuntimeHandlers) -> None:
        self._containers = containers
        self._handlers = handlers

    async def exec_sync(self, ref: str, cmd: list[str], timeout: float) -> ExecResult:
        if not cmd:
            raise InvalidArgument("ExecSyncRequest.cmd must not be empty")
        container = self._containers.get_running(ref)
        backend = self._handlers.backend_of(container)
        # A timeout of 0 means none (kubelet sends its probe timeout otherwise).
        try:
            result = await backend.exec_sync(container.id, cmd, timeout or None)
        except CriError:
            # A probe racing the container's exit: runc finds its namespaces gone. That is
            # a container that is not running, not a runtime failure.
            if not await asyncio.to_thread(_process_alive, container.pid):
                raise FailedPrecondition(
                    f"container {container.id} is not running (it exited as the command "
                    "was started)"
                ) from None
            raise
        if result.timed_out:
            # kubelet turns DEADLINE_EXCEEDED into a probe timeout, as with containerd.
            raise DeadlineExceeded(
                f"command {cmd[0]!r} in container {container.id} timed out after {timeout:g}s "
                "and was killed"
            )
        return result

    def streaming_endpoint(self, ref: str) -> ContainerEndpoint:
        """Where the streaming server reaches a container (exec, attach)."""
        container = self._containers.get(ref)
        backend = self._handlers.backend_of(container)
        return ContainerEndpoint(
            runtime_path=backend.runtime_path,
            runtime_root=backend.oci.root,
            attach_socket=backend.attach_socket(container.id),
            control_fifo=container.bundle_dir / "ctl",
            running=container.state == RUNNING,
            exec_options=tuple(backend.exec_options(container.id)),
            inside=backend.kind.inside,
            tty_options=backend.kind.tty_options,
        )


def _process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (whose namespaces are already gone)."""
    stat = process_stat(pid) if pid > 0 else None
    return stat is not None and stat[0] not in ("Z", "X")
