"""Containers: creation steps, lifecycle, teardown, restore and queries.

A container is an overlay root filesystem over its image's layers, an OCI bundle, and a
runc container held by one conmon. Like sandboxes, each creation step records its inverse
in the undo journal before the next step starts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.creation.coordinator import CreationCoordinator, Stage
from cri_shim.creation.names import container_name
from cri_shim.errors import (
    CriError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from cri_shim.faults import fault_point
from cri_shim.host import mounts
from cri_shim.images import overlay
from cri_shim.images.reference import parse_reference
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.events import (
    CONTAINER_CREATED,
    CONTAINER_DELETED,
    CONTAINER_STARTED,
    CONTAINER_STOPPED,
    EventBus,
)
from cri_shim.lifecycle.hooks import PersistedCreationHooks, restore_creations
from cri_shim.lifecycle.image_volumes import mount_image_volumes, resolve_image_volumes
from cri_shim.lifecycle.pause import PauseProcesses
from cri_shim.lifecycle.sandboxes import Pods
from cri_shim.nri.adjust import adjust_update, apply_adjustments, nri_resources_of
from cri_shim.nri.api import api_pb2 as nri_api
from cri_shim.nri.hooks import NriHooks
from cri_shim.nri.objects import container_of, container_of_record, pod_of_record
from cri_shim.runtime.apparmor import AppArmor
from cri_shim.runtime.cdi import CdiRegistry
from cri_shim.runtime.conmon import RuntimeBackend
from cri_shim.runtime.features import HandlerFeatures, handler_features, require_features
from cri_shim.runtime.host_limits import current_host_limits
from cri_shim.runtime.mount_sources import pin_bind_sources
from cri_shim.runtime.oci import ExecResult
from cri_shim.runtime.resources import clamp_oom_score_adj
from cri_shim.runtime.spec import ImageConfigView, SandboxContext, build_spec, resolve_stop_signal
from cri_shim.runtime.userns import pod_mappings
from cri_shim.state.containers import CREATED, EXITED, RUNNING, ContainerRepository
from cri_shim.state.journal import Journal
from cri_shim.state.records import ContainerRecord, ImageRecord, SandboxRecord
from cri_shim.streaming.runc_backend import ContainerEndpoint

log = logging.getLogger("cri_shim.container")

STAGE_STORAGE = "container storage"
STAGE_SPEC = "container spec"
STAGE_NRI = "container NRI plugins"
STAGE_RUNTIME = "container runtime creation"
STAGE_CREATED = "container created"


def _now_ns() -> int:
    return time.time_ns()


class ContainerLifecycle:
    """Every container: creation steps, lifecycle, teardown, runtime calls and queries."""

    def __init__(
        self,
        config: Config,
        rows: ContainerRepository,
        pods: Pods,
        journal: Journal,
        images: ImageStore,
        backends: dict[str, RuntimeBackend],
        *,
        events: EventBus,
        pause: PauseProcesses | None = None,
        nri: NriHooks | None = None,
    ) -> None:
        self.rows = rows
        self._nri = nri
        self._pods = pods
        self._config = config
        self._journal = journal
        self._images = images
        self.backends = backends
        self.events = events
        # A pod sharing one PID namespace: its containers join its pause process's.
        self._pause = pause
        self._dir = config.root / "containers"
        self._cdi = CdiRegistry(config.cdi.spec_dirs)
        # The host's AppArmor: RuntimeDefault loads the runtime's profile when first used.
        self.apparmor = AppArmor()
        hooks = PersistedCreationHooks(
            rows,
            journal,
            config.creation.cleanup_timeout,
            published=self._announce,
            before_undo=_teardown_starts,
            after_forget=self._gc_layers,
        )
        self.coordinator = CreationCoordinator(
            "container",
            hooks,
            claim_grace=config.creation.claim_grace,
            keep_on_timeout=config.creation.keep_on_timeout,
            hand_off=config.creation.hand_off,
            cleanup_timeout=config.creation.cleanup_timeout,
        )
        journal.register("runtime_delete", self._undo_runtime)
        journal.register("rootfs_unmount", self._undo_rootfs)
        journal.register("container_log", self._undo_log)
        journal.register("container_dir", self._undo_dir)

    # ---- CreateContainer -----------------------------------------------------------

    async def create(
        self,
        sandbox_ref: str,
        config: api_pb2.ContainerConfig,
        deadline: float | None,
    ) -> str:
        if not config.metadata.name:
            raise InvalidArgument("ContainerConfig.metadata.name must not be empty")
        if not config.image.image:
            raise InvalidArgument("ContainerConfig.image.image must not be empty")
        sandbox = self._pods.get_ready(sandbox_ref)
        image = self._images.get(config.image.image)
        if image is None:
            raise NotFound(f"image {config.image.image!r} not found: pull or import it first")
        handler = sandbox.runtime_handler or self._config.runtime.default_handler
        require_features(config, handler, self.features_of(handler))
        config = resolve_image_volumes(self._images, config)
        pod = sandbox.config.metadata
        name = container_name(
            config.metadata.name, pod.name, pod.namespace, pod.uid, config.metadata.attempt
        )
        log_path = self._log_path(sandbox, config)

        async def run(container_id: str, stage: Stage) -> None:
            await self._create(container_id, name, sandbox, config, image, log_path, stage)

        return await self.coordinator.create(name, deadline, run)

    def _log_path(self, sandbox: SandboxRecord, config: api_pb2.ContainerConfig) -> str:
        directory = sandbox.config.log_directory
        if not directory or not config.log_path:
            return ""
        if os.path.isabs(config.log_path):
            raise InvalidArgument(
                f"ContainerConfig.log_path {config.log_path!r} must be relative to the "
                "sandbox's log_directory"
            )
        base = os.path.realpath(directory)
        path = os.path.realpath(os.path.join(base, config.log_path))
        if os.path.commonpath([base, path]) != base:
            raise InvalidArgument(
                f"ContainerConfig.log_path {config.log_path!r} leaves the sandbox's log_directory"
            )
        return path

    async def _create(
        self,
        container_id: str,
        name: str,
        sandbox: SandboxRecord,
        config: api_pb2.ContainerConfig,
        image: ImageRecord,
        log_path: str,
        stage: Stage,
    ) -> None:
        """The creation's steps, each recording its inverse before it acts."""
        bundle = self._dir / container_id
        stage.set(STAGE_STORAGE)
        # The row comes first: restore finds an interrupted creation through it.
        image_name, repo_digest = image_names(image, config.image)
        self.rows.insert(
            container_id,
            name,
            sandbox.id,
            stage=STAGE_STORAGE,
            image_id=image.id,
            image_ref=image_name,
            repo_digest=repo_digest,
            config=config,
            log_path=log_path,
            bundle_dir=bundle,
            rootfs=bundle / "rootfs",
            layers=list(image.layers),
        )
        fault_point("container:row")
        context = self._sandbox_context(sandbox)
        image_mounts = await self._make_storage(
            container_id, bundle, config, image, log_path, context
        )

        stage.set(STAGE_SPEC)
        if self._pause is not None:
            # A pod sharing one PID namespace: the container joins its pause process's.
            context = await self._pause.join(sandbox, context)
        # It reads the image's /etc/passwd and /etc/group and the host's mount table.
        spec = await asyncio.to_thread(
            build_spec,
            config,
            context,
            _image_view(image),
            bundle / "rootfs",
            container_id=container_id,
            image_mounts=image_mounts,
            cdi=self._cdi,
            apparmor=self.apparmor,
        )
        if self._nri is not None and self._nri.enabled:
            stage.set(STAGE_NRI)
            await self._adjust_by_plugins(container_id, sandbox, config, spec)

        stage.set(STAGE_RUNTIME)
        pid = await self._create_in_runtime(
            container_id, sandbox, config, bundle, spec, context, log_path
        )
        self.rows.set_created(container_id, pid, spec["process"].get("user", {}))
        stage.set(STAGE_CREATED)
        if self._nri is not None and self._nri.enabled:
            container = container_of(container_id, sandbox.id, config, state="created", pid=pid)
            await self._nri.container_event(
                nri_api.POST_CREATE_CONTAINER, pod_of_record(sandbox), container
            )

    async def _adjust_by_plugins(
        self,
        container_id: str,
        sandbox: SandboxRecord,
        config: api_pb2.ContainerConfig,
        spec: dict[str, Any],
    ) -> None:
        """NRI plugins' adjustments, applied to the spec before runc sees it; a plugin's
        refusal fails the creation, which the journal rolls back."""
        assert self._nri is not None
        container = container_of(container_id, sandbox.id, config, spec=spec)
        adjustments = await self._nri.create_container(pod_of_record(sandbox), container)
        fault_point("container:nri-created")
        apply_adjustments(spec, adjustments)
        process = spec.get("process", {})
        if "oomScoreAdj" in process:
            # A plugin is held to the same floor as the request (DESIGN §5).
            process["oomScoreAdj"] = clamp_oom_score_adj(
                process["oomScoreAdj"], current_host_limits(), container_id
            )

    async def _make_storage(
        self,
        container_id: str,
        bundle: Path,
        config: api_pb2.ContainerConfig,
        image: ImageRecord,
        log_path: str,
        context: SandboxContext,
    ) -> dict[int, Path]:
        """The bundle directory, the overlay root filesystem and the image volumes; the
        host path of each image volume, by index in `config.mounts`."""
        rootfs = bundle / "rootfs"
        self._journal.record(container_id, "container_dir", path=str(bundle))
        for sub in ("upper", "work", "rootfs"):
            (bundle / sub).mkdir(parents=True, exist_ok=True)
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._journal.record(container_id, "rootfs_unmount", path=str(rootfs))
        lower = self._images.lower_dirs(image)
        if context.userns is None or context.userns_path is None:
            await asyncio.to_thread(
                overlay.mount_rootfs, lower, bundle / "upper", bundle / "work", rootfs
            )
        else:
            await asyncio.to_thread(
                functools.partial(
                    overlay.mount_idmapped_rootfs,
                    lower,
                    bundle / "upper",
                    bundle / "work",
                    rootfs,
                    userns_path=context.userns_path,
                    root_owner=context.userns.root_ids(),
                    staging=bundle / "idmap-layers",
                )
            )
        fault_point("container:rootfs")
        return await mount_image_volumes(
            self._journal,
            self.rows,
            self._images,
            container_id,
            bundle,
            config,
            userns_path=context.userns_path,
        )

    async def _create_in_runtime(
        self,
        container_id: str,
        sandbox: SandboxRecord,
        config: api_pb2.ContainerConfig,
        bundle: Path,
        spec: dict[str, Any],
        context: SandboxContext,
        log_path: str,
    ) -> int:
        """The runc container under its conmon; its process's pid."""
        backend = self._backend(sandbox.runtime_handler)
        if log_path and not await asyncio.to_thread(os.path.lexists, log_path):
            # conmon creates the log file. kubelet numbers the next attempt after the log
            # files in the pod's log directory when it knows no container of that name, so
            # a creation that is rolled back must take its file with it.
            self._journal.record(container_id, "container_log", path=log_path)
            fault_point("container:log-journaled")
        self._journal.record(
            container_id, "runtime_delete", handler=sandbox.runtime_handler, id=container_id
        )
        fault_point("container:runtime-journaled")
        # Host paths opened once and mounted by fd, so a swap cannot redirect runc's bind
        # mounts (issue 9); staging mounts left by a failure go with the bundle directory.
        # Opening host paths may block (a hung NFS mount): off the event loop.
        pinned = await asyncio.to_thread(
            pin_bind_sources,
            spec,
            config.mounts,
            bundle / "mounts",
            userns_path=context.userns_path,
        )
        pid = await backend.create(
            container_id,
            bundle,
            spec,
            Path(log_path or bundle / "container.log"),
            tty=config.tty,
            stdin=config.stdin,
            stdin_once=config.stdin_once,
        )
        if not backend.mounts_at_start:
            pinned.release()  # else the bundle directory's undo unmounts them
        fault_point("container:runtime-created")
        return pid

    def _sandbox_context(self, sandbox: SandboxRecord) -> SandboxContext:
        sc = sandbox.config.linux.security_context
        options = sc.namespace_options
        return SandboxContext(
            pod_id=sandbox.id,
            hostname=sandbox.hostname,
            netns_path=sandbox.netns_path,
            ipc_ns_path=sandbox.ipc_path,
            uts_ns_path=sandbox.uts_path,
            userns_path=sandbox.userns_path,
            userns=pod_mappings(sandbox.config) if sandbox.userns_path else None,
            host_pid=options.pid == api_pb2.NODE,
            resolv_conf_path=sandbox.sandbox_dir / "resolv.conf",
            hostname_path=sandbox.sandbox_dir / "hostname",
            hosts_path=sandbox.sandbox_dir / "hosts",
            shm_path=sandbox.sandbox_dir / "shm" if options.ipc != api_pb2.NODE else None,
            cgroup_parent=sandbox.config.linux.cgroup_parent,
            privileged=sc.privileged,
            run_as_user=sc.run_as_user.value if sc.HasField("run_as_user") else None,
            supplemental_groups=tuple(sc.supplemental_groups),
            supplemental_groups_policy=sc.supplemental_groups_policy,
            sysctls=dict(sandbox.config.linux.sysctls),
        )

    def features_of(self, handler: str) -> HandlerFeatures:
        """What a runtime handler supports (probed once, then remembered)."""
        return handler_features(self._backend(handler).runtime_path)

    def _backend(self, handler: str) -> RuntimeBackend:
        try:
            return self.backends[handler or self._config.runtime.default_handler]
        except KeyError:
            raise FailedPrecondition(f"runtime handler {handler!r} is not configured") from None

    # ---- undo actions --------------------------------------------------------------

    async def _undo_runtime(self, args: dict[str, Any]) -> None:
        await self._backend(args["handler"]).delete(args["id"])

    async def _undo_rootfs(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(overlay.unmount, Path(args["path"]))

    async def _undo_log(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(Path(args["path"]).unlink, missing_ok=True)

    async def _undo_dir(self, args: dict[str, Any]) -> None:
        path = Path(args["path"])
        await asyncio.to_thread(mounts.unmount_below, path)
        await asyncio.to_thread(shutil.rmtree, path, True)

    # ---- published ----------------------------------------------------------------

    def _announce(self, object_id: str) -> None:
        # A container kubelet knows of keeps its log when it is removed (kubelet deletes
        # the file itself, as with containerd and CRI-O); only a rollback removes it.
        self._journal.discharge(object_id, "container_log")
        # Visible now, so kubelet may hear of it: a cached creation is announced when a
        # retry claims it, never before (kubelet must not see it until then).
        sandbox_id = self.rows.sandbox_of(object_id)
        if sandbox_id is not None:
            self.events.emit(object_id, sandbox_id, CONTAINER_CREATED)

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self, ref: str) -> None:
        container = self.get(ref)
        if container.state != CREATED:
            raise FailedPrecondition(
                f"container {container.id} is {container.state}, only a created container can start"
            )
        sandbox = self._pods.get(container.sandbox_id)
        backend = self._backend(sandbox.runtime_handler)
        # Taken before the start: a process that exits at once must not look as if it
        # finished before it started.
        started_at = _now_ns()
        if self._nri is not None and self._nri.enabled:
            await self._nri.start_container(pod_of_record(sandbox), container_of_record(container))
        try:
            await backend.start(container.id)
        except CriError:
            # A start whose answer was lost (the daemon died after `runc start` and before
            # the row said so): the runtime knows better than the row.
            if await backend.state(container.id) not in ("running", "stopped"):
                raise
            log.warning("container %s (%s) was already started", container.id, container.name)
        fault_point("container:started")
        self.mark_started(container, started_at)
        if self._nri is not None and self._nri.enabled:
            await self._nri.container_event(
                nri_api.POST_START_CONTAINER, pod_of_record(sandbox), container_of_record(container)
            )

    def mark_started(self, container: ContainerRecord, started_at: int) -> None:
        container.state, container.started_at = RUNNING, started_at
        self.rows.mark_running(container.id, started_at)
        log.info("container %s (%s) started", container.id, container.name)
        self.events.emit(container.id, container.sandbox_id, CONTAINER_STARTED)
        # A process that exited at once wrote its exit file before the row said running;
        # the exit watcher found nothing to do then, so look now.
        self.notice_exit(container.id)

    async def stop(self, ref: str, timeout: float) -> None:
        container = self.find(ref)
        if container is None:
            return
        await self._stop(container, timeout)

    async def _stop(self, container: ContainerRecord, timeout: float) -> None:
        container = self.refresh(container)
        if container.state == EXITED:
            return
        backend = self._backend(self._handler_of(container))
        if container.state == CREATED:
            # Never started: nothing to signal; the runtime container is torn down on remove.
            await backend.stop(container.id, 0, signal.SIGKILL)
        else:
            image = self._images.get(container.image_id)
            try:
                stop_signal = resolve_stop_signal(
                    container.config, _image_view(image) if image else ImageConfigView()
                )
            except InvalidArgument as err:
                # Created before stop signals were checked: nothing may make a container
                # unkillable.
                log.warning("container %s: %s; stopping it with SIGKILL", container.id, err)
                stop_signal, timeout = signal.SIGKILL, 0
            await backend.stop(container.id, max(0.0, timeout), stop_signal)
        container = self._mark_exited(container, backend)
        log.info("container %s (%s) stopped", container.id, container.name)
        if self._nri is not None:
            await self._nri.settle(container.id)  # StopContainer answered before we are

    def _mark_exited(self, container: ContainerRecord, backend: RuntimeBackend) -> ContainerRecord:
        status = backend.exit_status(container.id)
        code, finished = status if status is not None else (137, _now_ns())
        # The exit file's mtime comes from the kernel's coarse clock, which can lag the
        # start time we took by a few milliseconds for a process that exits at once.
        finished = max(finished, container.started_at)
        if backend.oom_killed(container.id):
            reason = "OOMKilled"
        elif code == 0:
            reason = "Completed"
        else:
            reason = "Error"
        changed = self.rows.mark_exited(container.id, code, finished, reason)
        container.state, container.exit_code = EXITED, code
        container.finished_at, container.reason = finished, reason
        if changed:  # a stop and the exit watcher may both notice it; one event
            self.events.emit(container.id, container.sandbox_id, CONTAINER_STOPPED)
            if self._nri is not None:
                self._nri.container_exited(container.id)
        return container

    def mark_lost(self, container: ContainerRecord) -> None:
        log.warning(
            "container %s (%s): its process is gone and no exit was recorded",
            container.id,
            container.name,
        )
        self.rows.mark_exited(
            container.id,
            255,
            _now_ns(),
            "Unknown",
            message="the container's process disappeared without an exit record (host reboot?)",
        )
        self.events.emit(container.id, container.sandbox_id, CONTAINER_STOPPED)

    def refresh(self, container: ContainerRecord) -> ContainerRecord:
        """Pick up an exit that conmon recorded since we last looked."""
        if container.state != RUNNING:
            return container
        # Only the backend that runs it has its exit file: no need to look its handler
        # up (Status and List ask this of every container they answer with).
        for backend in self.backends.values():
            if backend.exit_status(container.id) is not None:
                return self._mark_exited(container, backend)
        return container

    async def remove(self, ref: str) -> None:
        """Hide the container and answer; its teardown (runc delete, unmounts, its
        directory) runs in the coordinator's task group from the journal.

        The row says `cleaning` before this returns, so a crash from here on is rolled
        forward by restore, and the name and the row (so the ID) stay held until the
        teardown has ended (DESIGN §4).
        """
        container = self.find(ref)
        if container is None:
            return
        await self._stop(container, 0)
        if self._nri is not None:
            # Plugins hear of the removal as kubelet does, before the teardown runs on.
            await self._nri.removed(container.id)
        self.rows.mark_cleaning(container.id)
        log.info("container %s (%s) removed; tearing down", container.id, container.name)
        self.events.emit(container.id, container.sandbox_id, CONTAINER_DELETED)
        self.coordinator.retire(container.name, object_id=container.id)

    async def _gc_layers(self, object_id: str) -> None:
        # Layers of an image removed while this container used them can go now.
        await asyncio.to_thread(self._images.gc_layers)

    async def stop_all_in(self, sandbox_id: str) -> None:
        await asyncio.gather(*(self._stop(c, 0) for c in self.list(sandbox_id=sandbox_id)))

    async def remove_all_in(self, sandbox_id: str) -> None:
        """Remove the sandbox's containers and wait for every teardown among them, those
        of earlier RemoveContainer calls included: the sandbox's own undo comes next."""
        for container in self.list(sandbox_id=sandbox_id):
            await self.remove(container.id)
        for row in self.rows.cleaning_in(sandbox_id):
            await self.coordinator.until_released(row.name, object_id=row.id)

    async def exec_sync(self, ref: str, cmd: list[str], timeout: float) -> ExecResult:
        if not cmd:
            raise InvalidArgument("ExecSyncRequest.cmd must not be empty")
        container = self.get_running(ref)
        # A timeout of 0 means none (kubelet sends its probe timeout otherwise).
        try:
            result = await self.backend_of(container).exec_sync(container.id, cmd, timeout or None)
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

    async def reopen_log(self, ref: str) -> None:
        container = self.get_running(ref)
        await self.backend_of(container).reopen_log(container.id)

    async def update_resources(
        self, ref: str, resources: api_pb2.LinuxContainerResources | Mapping[str, Any]
    ) -> None:
        """A CRI update, or OCI LinuxResources (an NRI plugin's update)."""
        container = self.get(ref)
        if container.state == EXITED:
            raise FailedPrecondition(f"container {container.id} has exited")
        backend = self.backend_of(container)
        nri = self._nri
        if (
            nri is None
            or not nri.enabled
            or not isinstance(resources, api_pb2.LinuxContainerResources)
        ):
            # Plugins' own updates come as OCI resources and are not told back to them.
            await backend.update_resources(container.id, resources)
            return
        # Plugins may change a CRI update before it is applied, or refuse it.
        pod, told = (
            pod_of_record(self._pods.get(container.sandbox_id)),
            container_of_record(container),
        )
        changes = await nri.update_container(pod, told, nri_resources_of(resources))
        if changes:
            changed = api_pb2.LinuxContainerResources()
            changed.CopyFrom(resources)
            adjust_update(changed, changes)
            resources = changed
        await backend.update_resources(container.id, resources)
        told.linux.resources.CopyFrom(nri_resources_of(resources))
        await nri.container_event(nri_api.POST_UPDATE_CONTAINER, pod, told)

    def streaming_endpoint(self, ref: str) -> ContainerEndpoint:
        """Where the streaming server reaches a container (exec, attach)."""
        container = self.get(ref)
        backend = self.backend_of(container)
        return ContainerEndpoint(
            runtime_path=backend.runtime_path,
            runtime_root=backend.oci.root,
            attach_socket=backend.attach_socket(container.id),
            control_fifo=container.bundle_dir / "ctl",
            running=container.state == RUNNING,
            exec_options=tuple(backend.exec_options(container.id)),
            no_tty_exec=backend.no_tty_exec,
        )

    def notice_exit(self, container_id: str | None) -> None:
        """conmon wrote an exit file (the exit watcher saw it): record the exit now, which
        emits the stopped event. None (events were lost) looks at every container."""
        if container_id is None:
            self.list()  # refreshes each running container
            return
        container = self.rows.visible(container_id)
        if container is not None:
            # Not visible (being created, or cached): its exit is read when it is claimed.
            self.refresh(container)

    def _handler_of(self, container: ContainerRecord) -> str:
        handler = self._pods.rows.runtime_handler(container.sandbox_id)
        return handler or self._config.runtime.default_handler

    def backend_of(self, container: ContainerRecord) -> RuntimeBackend:
        return self._backend(self._handler_of(container))

    # ---- queries (visible containers only) -----------------------------------------

    def find(self, ref: str) -> ContainerRecord | None:
        container = self.rows.find_visible(ref)
        return self.refresh(container) if container is not None else None

    def get(self, ref: str) -> ContainerRecord:
        container = self.find(ref)
        if container is None:
            raise NotFound(f"container {ref!r} not found")
        return container

    def get_running(self, ref: str) -> ContainerRecord:
        container = self.get(ref)
        if container.state != RUNNING:
            raise FailedPrecondition(f"container {container.id} is not running ({container.state})")
        return container

    def _refresh_all(self, containers: list[ContainerRecord]) -> list[ContainerRecord]:
        """refresh() for many: each backend's exit files are listed once, and only the
        containers that have one are looked at. A file looked for per running container
        was a quarter of what a listing cost."""
        exited: set[str] = set().union(*(b.recorded_exits() for b in self.backends.values()))
        return [self.refresh(c) if c.state == RUNNING and c.id in exited else c for c in containers]

    def list(self, sandbox_id: str | None = None) -> list[ContainerRecord]:
        if sandbox_id is None:
            containers = self.rows.list_visible()
        else:
            containers = self.rows.list_visible_in(sandbox_id)
        return self._refresh_all(containers)

    def ids(self) -> set[str]:
        """Every container with a row, whatever its phase."""
        return self.rows.ids()

    # ---- restore -------------------------------------------------------------------

    async def restore(self) -> None:
        await restore_creations(
            self.rows, self.coordinator, self._journal, self._config.creation.cleanup_timeout
        )
        # Containers that exited while the daemon was down: conmon's exit files say how.
        for container in self.list():
            self.refresh(container)


async def _teardown_starts(object_id: str) -> None:
    fault_point("container:teardown")


def _process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (whose namespaces are already gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return pid > 0 and stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def image_names(image: ImageRecord, spec: api_pb2.ImageSpec) -> tuple[str, str]:
    """The image as the user named it, and as a repository digest reference (or "").

    kubelet names the image by its ID in `image` and passes the pod spec's name in
    `user_specified_image`; people read the name, and the digest reference, back from
    ContainerStatus (containerd reports them so too)."""
    named = spec.user_specified_image or spec.image
    hex_part = named.removeprefix("sha256:")
    if hex_part and image.id.removeprefix("sha256:").startswith(hex_part):
        named = next(iter(image.repo_tags), image.id)  # named by ID: its first tag, if any
    try:
        repository = parse_reference(named).name
    except CriError:
        repository = ""
    matching = [d for d in image.repo_digests if d.partition("@")[0] == repository]
    return named, next(iter(matching or image.repo_digests), "")


def _image_view(image: ImageRecord) -> ImageConfigView:
    return ImageConfigView(
        entrypoint=tuple(image.entrypoint),
        cmd=tuple(image.cmd),
        env=tuple(image.env),
        working_dir=image.working_dir,
        user=image.user,
        stop_signal=image.stop_signal,
    )
