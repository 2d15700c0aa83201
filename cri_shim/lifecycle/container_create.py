"""CreateContainer: the creation's steps, their undo actions, and the publication.

A container is an overlay root filesystem over its image's layers, an OCI bundle, and a
runc container held by one conmon. Like a sandbox's, each creation step records its
inverse in the undo journal before the next step starts, so that a failure, an expiry, a
removal and a restart all undo it the same way.
"""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cri_shim import tracing
from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.creation.coordinator import Stage
from cri_shim.creation.names import container_name
from cri_shim.errors import InvalidArgument, NotFound
from cri_shim.faults import fault_point
from cri_shim.host import mounts
from cri_shim.images import overlay
from cri_shim.images.store import ImageStore
from cri_shim.lifecycle.container_images import image_config_view, image_names
from cri_shim.lifecycle.container_rules import check_container
from cri_shim.lifecycle.events import CONTAINER_CREATED, EventBus
from cri_shim.lifecycle.image_volumes import mount_image_volumes, resolve_image_volumes
from cri_shim.lifecycle.pause import SandboxContainers
from cri_shim.lifecycle.persisted_creation import persisted_coordinator
from cri_shim.lifecycle.pods import Pods
from cri_shim.lifecycle.runtime_handlers import RuntimeHandlers
from cri_shim.runtime.apparmor import AppArmor
from cri_shim.runtime.cdi_on_demand import CdiOnDemand
from cri_shim.runtime.cgroup_driver import CGROUPFS_DRIVER, CgroupDriver, driver_named
from cri_shim.runtime.features import require_features
from cri_shim.runtime.host_limits import current_host_limits
from cri_shim.runtime.mount_sources import PinnedSources, pin_bind_sources, release_staging
from cri_shim.runtime.resources import clamp_oom_score_adj
from cri_shim.runtime.spec import SandboxContext, build_spec
from cri_shim.runtime.userns import pod_mappings
from cri_shim.state.containers import ContainerRepository
from cri_shim.state.journal import Journal
from cri_shim.state.records import ImageRecord, SandboxRecord

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

STAGE_STORAGE = "container storage"
STAGE_SPEC = "container spec"
STAGE_NRI = "container NRI plugins"
STAGE_RUNTIME = "container runtime creation"
STAGE_CREATED = "container created"


class ContainerCreate:
    """Runs each container's creation under the creation contract (its coordinator)."""

    def __init__(
        self,
        config: Config,
        rows: ContainerRepository,
        pods: Pods,
        journal: Journal,
        images: ImageStore,
        handlers: RuntimeHandlers,
        events: EventBus,
        pause: SandboxContainers | None,
        nri: NriHooks | None,
        tracer: tracing.Tracer = tracing.NO_TRACER,
    ) -> None:
        self._config = config
        self._rows = rows
        self._pods = pods
        self._journal = journal
        self._images = images
        self._handlers = handlers
        self._events = events
        # A pod sharing one PID namespace: its containers join its pause process's.
        self._pause = pause
        self._nri = nri
        self._dir = config.root / "containers"
        self._cdi = CdiOnDemand(config.cdi.spec_dirs)
        # The host's AppArmor: RuntimeDefault loads the runtime's profile when first used.
        self.apparmor = AppArmor()
        self.coordinator = persisted_coordinator(
            "container",
            rows,
            journal,
            config.creation,
            published=self.announce,
            before_undo=_teardown_starts,
            after_forget=self._gc_layers,
            tracer=tracer,
        )
        journal.register("runtime_delete", self._undo_runtime)
        journal.register("rootfs_unmount", self._undo_rootfs)
        journal.register("container_log", self._undo_log)
        journal.register("container_dir", self._undo_dir)

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
        await asyncio.to_thread(check_container, config)  # stats host paths, reads sysfs
        sandbox = self._pods.get_ready(sandbox_ref)
        image = self._images.get(config.image.image)
        if image is None:
            raise NotFound(f"image {config.image.image!r} not found: pull or import it first")
        handler = sandbox.runtime_handler or self._config.runtime.default_handler
        require_features(config, handler, self._handlers.features_of(handler))
        config = resolve_image_volumes(self._images, config)
        pod = sandbox.config.metadata
        name = container_name(
            config.metadata.name, pod.name, pod.namespace, pod.uid, config.metadata.attempt
        )
        log_path = _log_path(sandbox, config)

        async def run(container_id: str, stage: Stage) -> None:
            await self._create(container_id, name, sandbox, config, image, log_path, stage)

        return await self.coordinator.create(name, deadline, run)

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
        # The row comes first: restore finds an interrupted creation through it. It is
        # committed with the undo of the storage steps, which may run before those steps
        # did (an unmount of what is not mounted, the removal of a missing directory).
        image_name, repo_digest = image_names(image, config.image)
        with self._journal.batch():
            self._rows.insert(
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
            self._journal.record(container_id, "container_dir", path=str(bundle))
            self._journal.record(container_id, "rootfs_unmount", path=str(bundle / "rootfs"))
        fault_point("container:row")
        context = sandbox_context(sandbox, driver_named(self._config.cgroup_manager))
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
            image_config_view(image),
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
        self._rows.set_created(container_id, pid, spec["process"].get("user", {}))
        stage.set(STAGE_CREATED)
        if self._nri is not None and self._nri.enabled:
            from cri_shim.nri.api import api_pb2 as nri_api
            from cri_shim.nri.objects import container_of, pod_of_record

            container = container_of(container_id, sandbox.id, config, state="created", pid=pid)
            await self._nri.container_event(
                nri_api.POST_CREATE_CONTAINER, pod_of_record(sandbox), container
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
        """The bundle directory, the overlay root filesystem (its mount makes the bundle's
        directories) and the image volumes; the host path of each image volume, by index
        in `config.mounts`. Their undo is journaled with the row."""
        rootfs = bundle / "rootfs"
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
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
            self._rows,
            self._images,
            container_id,
            bundle,
            config,
            userns_path=context.userns_path,
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
        from cri_shim.nri.adjust import apply_adjustments
        from cri_shim.nri.objects import container_of, pod_of_record

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
        backend = self._handlers.backend(sandbox.runtime_handler)
        # Host paths opened once and mounted by fd, so that a path swapped for a symlink
        # between the request's check and runc's mount cannot redirect a bind mount;
        # staging mounts left by a failure go with the bundle directory. Opening host
        # paths (and looking for the log) may block on a hung NFS mount: off the loop.
        new_log, pinned = await asyncio.to_thread(
            _pin_host_paths, spec, config, bundle, log_path, context.userns_path
        )
        with self._journal.batch():
            if new_log:
                # conmon creates the log file. kubelet numbers the next attempt after the
                # log files in the pod's log directory when it knows no container of that
                # name, so a creation that is rolled back must take its file with it.
                self._journal.record(container_id, "container_log", path=log_path)
            self._journal.record(
                container_id, "runtime_delete", handler=sandbox.runtime_handler, id=container_id
            )
        if new_log:
            fault_point("container:log-journaled")
        fault_point("container:runtime-journaled")
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

    # ---- undo actions --------------------------------------------------------------

    async def _undo_runtime(self, args: dict[str, Any]) -> None:
        await self._handlers.backend(args["handler"]).delete(args["id"])

    async def _undo_rootfs(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(overlay.unmount, Path(args["path"]))

    async def _undo_log(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(Path(args["path"]).unlink, missing_ok=True)

    async def _undo_dir(self, args: dict[str, Any]) -> None:
        path = Path(args["path"])
        # Staging mounts first, severed from what they copy: unmounted one by one, the
        # copies inside them would take the host's own mounts with them.
        await asyncio.to_thread(release_staging, path / "mounts")
        await asyncio.to_thread(mounts.remove_tree, path)

    async def _gc_layers(self, object_id: str) -> None:
        # Layers of an image removed while this container used them can go now.
        await asyncio.to_thread(self._images.gc_layers)

    # ---- published ----------------------------------------------------------------

    def announce(self, object_id: str) -> None:
        # A container kubelet knows of keeps its log when it is removed (kubelet deletes
        # the file itself, as with containerd and CRI-O); only a rollback removes it.
        self._journal.discharge(object_id, "container_log")
        # Visible now, so kubelet may hear of it: a cached creation is announced when a
        # retry claims it, never before (kubelet must not see it until then).
        sandbox_id = self._rows.sandbox_of(object_id)
        if sandbox_id is not None:
            self._events.emit(object_id, sandbox_id, CONTAINER_CREATED)


def _pin_host_paths(
    spec: dict[str, Any],
    config: api_pb2.ContainerConfig,
    bundle: Path,
    log_path: str,
    userns_path: Path | None,
) -> tuple[bool, PinnedSources]:
    """Whether the log file is still to be made (conmon makes it), and the bind mounts'
    host paths pinned (pin_bind_sources): one trip off the loop for both."""
    new_log = bool(log_path) and not os.path.lexists(log_path)
    return new_log, pin_bind_sources(spec, config.mounts, bundle / "mounts", userns_path)


async def _teardown_starts(object_id: str) -> None:
    fault_point("container:teardown")


def _log_path(sandbox: SandboxRecord, config: api_pb2.ContainerConfig) -> str:
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


def sandbox_context(
    sandbox: SandboxRecord, cgroup_driver: CgroupDriver = CGROUPFS_DRIVER
) -> SandboxContext:
    """What a container's spec takes from its pod: namespaces, files, security context."""
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
        cgroup_driver=cgroup_driver,
        privileged=sc.privileged,
        run_as_user=sc.run_as_user.value if sc.HasField("run_as_user") else None,
        supplemental_groups=tuple(sc.supplemental_groups),
        supplemental_groups_policy=sc.supplemental_groups_policy,
        sysctls=dict(sandbox.config.linux.sysctls),
    )
