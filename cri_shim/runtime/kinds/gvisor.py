"""gVisor (`runsc`): its own kernel (the Sentry) runs the pod as one sandbox, which its
containers join.

So the host's PID, IPC and network namespaces are not the host's inside it, a privileged
container gets no host devices or capabilities, and it maps no user namespace. conmon runs
runsc through a script that gives it a process to wait for, a joining container is
started with its waiter's stdio, exec runs as the container's user and is killed inside
the sandbox with all its processes by one `runsc exec` there, runsc's leftover lock files
are removed with the container, and the limits go to the host cgroups, summed over the
pod (runsc before 2026 has no `update`: PodCgroupLimits below, over
runtime/sandbox_cgroups.py). The mechanisms are in runtime/gvisor.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import CriError, FailedPrecondition, NotFound
from cri_shim.runtime import gvisor
from cri_shim.runtime.cgroup_driver import cgroup_dir
from cri_shim.runtime.container_files import write_atomic
from cri_shim.runtime.features import HandlerFeatures
from cri_shim.runtime.kinds.base import (
    CONTAINER_TYPE,
    SANDBOX_ID,
    ContainerLimits,
    HandlerKind,
    KillInside,
    KindContext,
    OciCommands,
)
from cri_shim.runtime.sandbox_cgroups import (
    merged_resources,
    pod_total,
    read_spec,
    record_overhead,
    recorded_overhead,
    unappliable,
    write_cgroup,
)

GVISOR = HandlerFeatures(host_namespaces=False, privileged=False, engine="gVisor kernel")
# gVisor's check for the host's network namespace, which newer kernels fool.
_NETSTACK_REFUSED = "cannot run with network enabled in root network namespace"


class GVisorKind(HandlerKind):
    engine = GVISOR.engine
    pod_sandbox = True
    mounts_at_start = True  # a container's gofer is started with it
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

    def limits(self, handler: KindContext) -> ContainerLimits:
        return PodCgroupLimits(handler)

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


class PodCgroupLimits(ContainerLimits):
    """The runtime applies no limits of its own: the pod sandbox's host cgroup gets the
    sum of its containers' limits, and an update rewrites the host cgroups."""

    def __init__(self, handler: KindContext) -> None:
        super().__init__(handler)
        self.handler_name = handler.handler_name
        self._files = handler.files
        # One lock per pod sandbox over each read-sum-write of the pod's total, taken when
        # first needed and dropped when the sandbox is deleted.
        self._pod_locks: dict[str, asyncio.Lock] = {}

    async def created(self, spec: Mapping[str, Any]) -> None:
        # The pod's sandbox grows by what the container may use.
        sandbox_id = (spec.get("annotations") or {}).get(SANDBOX_ID, "")
        await self._in_pod(sandbox_id, self._resize_sandbox, spec)

    async def update(self, container_id: str, resources: Mapping[str, Any]) -> None:
        # No `update` in the runtime (runsc): the host cgroups, where its limits apply.
        sandbox_id = await asyncio.to_thread(self._sandbox_of, container_id)
        await self._in_pod(sandbox_id, self._update_on_pod_cgroup, container_id, resources)

    def forget(self, container_id: str) -> None:
        self._pod_locks.pop(container_id, None)  # the pod's, when this is its sandbox

    async def _in_pod(self, sandbox_id: str, work: Callable[..., None], *args: Any) -> None:
        """Run `work` on a thread under the pod's lock: each update reads every
        container's limits, sums them and writes the sandbox's cgroup, and two at once
        would each sum the other's old limits (the pod left below its containers' total,
        OOM-killed inside its limits). A cancelled caller leaves the lock held until the
        thread has written: it cannot be stopped half-way."""
        if not sandbox_id:
            await asyncio.to_thread(work, *args)
            return
        lock = self._pod_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            job = asyncio.ensure_future(asyncio.to_thread(work, *args))
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                await asyncio.wait([job])
                raise

    def _sandbox_of(self, container_id: str) -> str:
        """The pod sandbox a container joins ("" where its spec cannot be read)."""
        meta = self._files.read_meta(container_id)
        spec = read_spec(Path(meta.bundle)) if meta is not None else None
        return str(((spec or {}).get("annotations") or {}).get(SANDBOX_ID) or "")

    def _update_on_pod_cgroup(self, container_id: str, update: Mapping[str, Any]) -> None:
        """New limits of a container whose limits are on its pod's cgroup
        (runtime/sandbox_cgroups.py): the pod's new total on the sandbox's cgroup first
        (where the kernel may refuse a lower memory limit), then the container's own cgroup,
        then its spec, the record of both."""
        meta = self._files.read_meta(container_id)
        spec = read_spec(Path(meta.bundle)) if meta is not None else None
        if meta is None or spec is None:
            raise NotFound(
                f"container {container_id} is not known to runtime handler {self.handler_name}"
            )
        refused = unappliable(update)
        if refused:
            raise FailedPrecondition(
                f"runtime handler {self.handler_name!r} (gVisor) cannot apply "
                f"{', '.join(refused)} to a running container: its limits apply to the pod's "
                "sandbox as a whole, summed over the pod's containers, which these cannot be"
            )
        linux = spec.setdefault("linux", {})
        resources = merged_resources(linux.get("resources") or {}, update)
        self._resize_sandbox(spec, {container_id: resources})
        self._write_cgroup(meta.cgroups_path, resources)
        linux["resources"] = resources
        write_atomic(Path(meta.bundle) / "config.json", json.dumps(spec).encode())

    def _resize_sandbox(
        self, spec: Mapping[str, Any], changed: Mapping[str, Mapping[str, Any]] | None = None
    ) -> None:
        """Give the sandbox a container joins the total of the limits of its
        containers (`changed` overrides what their specs say)."""
        annotations = spec.get("annotations") or {}
        if annotations.get(CONTAINER_TYPE) != "container":
            return
        sandbox_id = annotations.get(SANDBOX_ID, "")
        sandbox = self._files.read_meta(sandbox_id) if sandbox_id else None
        if sandbox is None:
            return
        members = dict(changed or {})
        for cdir in self._files.containers.iterdir():
            meta = self._files.read_meta(cdir.name)
            if cdir.name in members or meta is None:
                continue
            # Only the pod's specs are parsed: every container of the handler is read.
            member = read_spec(Path(meta.bundle), mentioning=sandbox_id)
            if member is None:
                continue
            marks = member.get("annotations") or {}
            if marks.get(CONTAINER_TYPE) == "container" and marks.get(SANDBOX_ID) == sandbox_id:
                members[cdir.name] = (member.get("linux") or {}).get("resources") or {}
        overhead = recorded_overhead(read_spec(Path(sandbox.bundle)) or {})
        self._write_cgroup(sandbox.cgroups_path, pod_total(members.values(), overhead))

    def _write_cgroup(self, cgroups_path: str, resources: Mapping[str, Any]) -> None:
        host = self._handler.host_limits()
        write_cgroup(
            cgroup_dir(cgroups_path),
            resources,
            v2=host.cgroup_v2,
            swap_accounting=host.swap_accounting,
            cgroup_root=self._handler.cgroup_root,
        )
