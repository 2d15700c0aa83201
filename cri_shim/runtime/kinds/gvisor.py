"""gVisor (`runsc`): its own kernel (the Sentry) runs the pod as one sandbox, which its
containers join.

So the host's PID, IPC and network namespaces are not the host's inside it, a privileged
container gets no host devices or capabilities, and it maps no user namespace. conmon runs
runsc through a script that gives it a process to wait for, a joining container is
started with its waiter's stdio, exec runs as the container's user and is killed inside
the sandbox with all its processes by one `runsc exec` there, runsc's leftover lock files
are removed with the container, and the limits go to the host cgroups, summed over the
pod (runsc before 2026 has no `update`; runtime/sandbox_cgroups.py). The mechanisms are
in runtime/gvisor.py.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError, FailedPrecondition
from cri_shim.runtime import gvisor
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.runtime.kinds.base import HandlerKind, KillInside, OciCommands
from cri_shim.runtime.sandbox_cgroups import record_overhead

GVISOR = HandlerFeatures(host_namespaces=False, privileged=False, engine="gVisor kernel")
# gVisor's check for the host's network namespace, which newer kernels fool.
_NETSTACK_REFUSED = "cannot run with network enabled in root network namespace"


class GVisorKind(HandlerKind):
    engine = GVISOR.engine
    pod_sandbox = True
    mounts_at_start = True  # a container's gofer is started with it
    limits_on_pod_cgroup = True
    pid_namespace_of_sandbox = True
    tty_options = ()  # runsc has no `--tty`: the console socket is its terminal option

    def features(self) -> HandlerFeatures:
        return GVISOR

    @property
    def inside(self) -> KillInside | None:
        return gvisor.kill_process_tree

    def conmon_runtime(self, state_dir: Path, handler: str) -> Path:
        return gvisor.conmon_runtime(self.runtime_path, state_dir, handler)

    def prepare_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        spec = copy.deepcopy(spec)
        gvisor.drop_unknown_capabilities(spec)
        return spec

    def prepare_pod_sandbox(
        self, spec: dict[str, Any], rootfs: Path, pod: api_pb2.PodSandboxConfig
    ) -> None:
        gvisor.relay_mount(spec, rootfs)  # port-forward's way into the sandbox
        # What the sandbox itself may use on top of its containers (RuntimeClass
        # overhead): part of the pod's total its cgroup gets (runtime/sandbox_cgroups.py).
        record_overhead(spec, pod.linux.overhead)

    def start_refused(self, handler: str, err: CriError) -> CriError | None:
        if _NETSTACK_REFUSED not in str(err):
            return None
        return FailedPrecondition(
            f"runtime handler {handler!r} could not start the pod's sandbox: {err} (runsc "
            "releases before August 2024 mistake every network namespace for the host's "
            "on Linux 6.11 and newer: install a newer runsc, or set "
            f'[runtime.handlers.{handler}] runtime_args = ["--network=host"], which '
            "gives the pod the kernel's network stack in its own namespace)"
        )

    def start_env(self, bundle: Path) -> Mapping[str, str]:
        # A joining container takes the stdio of `runsc start`: its waiter's.
        waiter = gvisor.joining_waiter(bundle)
        return {gvisor.STDIO_ENV: str(waiter)} if waiter else {}

    def end_unstarted(self, bundle: Path, err: CriError) -> bool:
        # runsc cannot signal a container that joins a sandbox before it is started;
        # nothing runs yet, so ending its waiter is its exit.
        waiter = gvisor.joining_waiter(bundle)
        if not waiter or "in state created" not in str(err):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(waiter, signal.SIGKILL)
        return True

    async def delete(self, oci: OciCommands, container_id: str, bundle: Path | None) -> None:
        sandboxes = gvisor.sandboxes_of(oci.root, container_id)
        await oci.delete(container_id, force=True)
        gvisor.remove_locks(oci.root, container_id, sandboxes)
        if bundle is not None:
            gvisor.wake_waiter(bundle)  # one of a never-started container ends

    def exec_options(self, bundle: Path) -> list[str]:
        return gvisor.exec_user_args(bundle)

    def check_port_forward(self, handler: str, runtime_args: Sequence[str]) -> None:
        gvisor.require_port_forward(handler, runtime_args)

    def relay_argv(
        self, root: Path, runtime_args: Sequence[str], sandbox_id: str, port: int
    ) -> list[str] | None:
        if gvisor.relay_program() is None:
            return None
        return gvisor.relay_argv(self.runtime_path, root, runtime_args, sandbox_id, port)
