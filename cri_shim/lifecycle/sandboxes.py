"""Pod sandboxes: their creation steps, teardown, restore and queries.

There is no infra container. A sandbox is a directory (resolv.conf, hostname, hosts, a
per-pod /dev/shm), pinned network/UTS/IPC namespaces, and a CNI attachment. Each step
records its inverse in the undo journal before the next one starts, so that a failure, an
expiry, a removal and a restart all undo the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.creation.coordinator import CreationCoordinator, Stage
from cri_shim.creation.names import sandbox_name
from cri_shim.errors import FailedPrecondition, InvalidArgument, NotFound
from cri_shim.faults import fault_point
from cri_shim.host import mounts
from cri_shim.host.idmap import UserNamespaceMappings
from cri_shim.lifecycle.events import (
    CONTAINER_CREATED,
    CONTAINER_DELETED,
    CONTAINER_STARTED,
    CONTAINER_STOPPED,
    EventBus,
)
from cri_shim.lifecycle.hooks import PersistedCreationHooks, restore_creations
from cri_shim.lifecycle.pause import PAUSE_ACTION, PauseProcesses, shares_pid_namespace
from cri_shim.logcontext import object_fields
from cri_shim.network.cni import CniNetwork, PodNetworkRequest
from cri_shim.network.netns import USERNS_DIR, NamespacePinner, PinnedNamespaces
from cri_shim.nri.hooks import POD_STOPPED as NRI_POD_STOPPED
from cri_shim.nri.hooks import NriHooks
from cri_shim.nri.objects import pod_of
from cri_shim.runtime.features import HandlerFeatures, require_pod_features
from cri_shim.runtime.spec import SandboxContext
from cri_shim.runtime.userns import pod_mappings, require_searchable
from cri_shim.state.journal import Journal, UndoFailed
from cri_shim.state.ledger import Ledger
from cri_shim.state.records import SandboxRecord, host_network, pod_hostname
from cri_shim.state.sandboxes import SandboxRepository

log = logging.getLogger("cri_shim.sandbox")

STAGE_STORAGE = "sandbox storage"
STAGE_NAMESPACES = "sandbox namespaces"
STAGE_PID_NAMESPACE = "sandbox pid namespace"
STAGE_NETWORK = "sandbox network"
STAGE_POD_SANDBOX = "sandbox container"
STAGE_NRI = "sandbox NRI plugins"
STAGE_READY = "sandbox ready"

# Steps that StopPodSandbox undoes; the directory and the rows stay until RemovePodSandbox.
# NRI's StopPodSandbox, journaled last, is undone first: plugins hear of the stop before
# the network goes.
_STOP_ACTIONS = (NRI_POD_STOPPED, "cni_del", "unpin", "unmount", PAUSE_ACTION)

SHM_SIZE = 64 * 1024 * 1024


class PodContainers(Protocol):
    """What a pod's stop and removal do to its containers (the container lifecycle)."""

    async def stop_all_in(self, sandbox_id: str) -> None: ...

    async def remove_all_in(self, sandbox_id: str) -> None: ...


class Pods:
    """Visible sandboxes by reference, for what acts on a pod (its containers, its
    port-forwards). Reads rows only, so that it exists before the lifecycles do."""

    def __init__(
        self,
        rows: SandboxRepository,
        forwardable: Callable[[SandboxRecord], None] | None = None,
    ) -> None:
        self.rows = rows
        # Refuses port-forward into a pod whose runtime cannot serve it (gVisor's netstack).
        self._forwardable = forwardable

    def find(self, ref: str) -> SandboxRecord | None:
        return self.rows.find_visible(ref)

    def get(self, ref: str) -> SandboxRecord:
        sandbox = self.find(ref)
        if sandbox is None:
            raise NotFound(f"pod sandbox {ref!r} not found")
        return sandbox

    def get_ready(self, ref: str) -> SandboxRecord:
        sandbox = self.get(ref)
        if not sandbox.ready:
            raise FailedPrecondition(f"pod sandbox {sandbox.id} is not ready (it was stopped)")
        return sandbox

    def list(self) -> list[SandboxRecord]:
        return self.rows.list_visible()

    def netns_of(self, ref: str) -> Path | None:
        """The pinned network namespace of a ready pod (port-forward dials into it); None
        for a host-network pod, which shares the daemon's own."""
        sandbox = self.get_ready(ref)
        if self._forwardable is not None:
            self._forwardable(sandbox)
        return sandbox.netns_path


class SandboxLifecycle:
    """Every sandbox's creation steps, teardown, restore and queries."""

    def __init__(
        self,
        config: Config,
        pods: Pods,
        journal: Journal,
        ledger: Ledger,
        pinner: NamespacePinner,
        cni: CniNetwork,
        *,
        events: EventBus,
        containers: PodContainers,
        handler_features: Callable[[str], HandlerFeatures],
        pause: PauseProcesses | None = None,
        nri: NriHooks | None = None,
    ) -> None:
        self.pods = pods
        self._nri = nri
        self.rows = pods.rows
        self._config = config
        self._journal = journal
        self._ledger = ledger
        self.pinner = pinner
        self._cni = cni
        # Shared with the container lifecycle: GetContainerEvents streams both.
        self.events = events
        # Stop and removal of a pod reach its containers first.
        self._containers = containers
        # What each runtime handler supports (the container lifecycle owns the handlers).
        self._handler_features = handler_features
        # The PID 1 of pods that share one PID namespace; None refuses such pods.
        self.pause = pause
        self._dir = config.root / "sandboxes"
        hooks = PersistedCreationHooks(
            self.rows,
            journal,
            config.creation.cleanup_timeout,
            published=self._announce,
            before_undo=containers.remove_all_in,
        )
        self.coordinator = CreationCoordinator(
            "sandbox",
            hooks,
            claim_grace=config.creation.claim_grace,
            keep_on_timeout=config.creation.keep_on_timeout,
            hand_off=config.creation.hand_off,
            cleanup_timeout=config.creation.cleanup_timeout,
        )
        journal.register("cni_del", self._undo_cni)
        journal.register("unpin", self._undo_unpin)
        journal.register("unmount", self._undo_unmount)
        journal.register("remove_dir", self._undo_remove_dir)

    # ---- RunPodSandbox -------------------------------------------------------------

    async def run(
        self, config: api_pb2.PodSandboxConfig, runtime_handler: str, deadline: float | None
    ) -> str:
        meta = config.metadata
        for field in ("name", "uid", "namespace"):
            if not getattr(meta, field):
                raise InvalidArgument(f"PodSandboxConfig.metadata.{field} must not be empty")
        handler = runtime_handler or self._config.runtime.default_handler
        if handler not in self._config.runtime.handlers:
            known = ", ".join(sorted(self._config.runtime.handlers))
            raise InvalidArgument(f"unknown runtime handler {handler!r} (configured: {known})")
        features = self._handler_features(handler)
        userns = pod_mappings(config)
        require_pod_features(userns, handler, features, config)
        if userns is not None:
            require_searchable(self._config.root)
        name = sandbox_name(meta.name, meta.namespace, meta.uid, meta.attempt)

        async def create(sandbox_id: str, stage: Stage) -> None:
            await self._create(sandbox_id, name, config, handler, userns, stage)

        return await self.coordinator.create(name, deadline, create)

    async def _create(
        self,
        sandbox_id: str,
        name: str,
        config: api_pb2.PodSandboxConfig,
        handler: str,
        userns: UserNamespaceMappings | None,
        stage: Stage,
    ) -> None:
        sandbox_dir = self._dir / sandbox_id
        stage.set(STAGE_STORAGE)
        # The row comes first: everything after it is a side effect that a crash may
        # interrupt, and restore finds interrupted creations through this row.
        self.rows.insert(sandbox_id, name, STAGE_STORAGE, handler, config, sandbox_dir)
        fault_point("sandbox:row")
        self._journal.record(sandbox_id, "remove_dir", path=str(sandbox_dir))
        sandbox_dir.mkdir(parents=True, exist_ok=True)
        self._write_files(sandbox_id, sandbox_dir, config)
        if config.log_directory:
            os.makedirs(config.log_directory, exist_ok=True)
        fault_point("sandbox:files")
        shm = sandbox_dir / "shm"
        shm.mkdir(exist_ok=True)
        self._journal.record(sandbox_id, "unmount", path=str(shm))
        mounts.mount_tmpfs(shm, size=SHM_SIZE, mode=0o1777)
        fault_point("sandbox:shm")

        stage.set(STAGE_NAMESPACES)
        options = config.linux.security_context.namespace_options
        hostnet = host_network(config)
        pins = self.pinner
        for kind, wanted in (
            ("netns", not hostnet),
            ("utsns", not hostnet),
            ("ipcns", options.ipc != api_pb2.NODE),
            (USERNS_DIR, userns is not None),
        ):
            if wanted:
                path = self._config.run_root / kind / sandbox_id
                self._ledger.allocate("path", str(path), sandbox_id)
                self._journal.record(sandbox_id, "unpin", path=str(path), owner=sandbox_id)
        pinned = await pins.pin(
            sandbox_id,
            net=not hostnet,
            uts=not hostnet,
            ipc=options.ipc != api_pb2.NODE,
            hostname=pod_hostname(config, sandbox_id),
            userns=userns,
        )
        self.rows.set_namespaces(
            sandbox_id, net=pinned.net, ipc=pinned.ipc, uts=pinned.uts, user=pinned.user
        )
        fault_point("sandbox:namespaces")

        pod_sandbox = self.pause is not None and self.pause.is_pod_sandbox(handler)
        if shares_pid_namespace(config) and not pod_sandbox:
            stage.set(STAGE_PID_NAMESPACE)
            await self._start_pause(sandbox_id, sandbox_dir, config, handler, pinned, userns)

        ips: list[str] = []
        result: dict[str, Any] | None = None
        if pinned.net is not None:
            stage.set(STAGE_NETWORK)
            request = self._network_request(sandbox_id, config, pinned.net)
            # DEL is journaled before ADD: a plugin may allocate an address and then fail,
            # and only a DEL gives that address back.
            seq = self._journal.record(sandbox_id, "cni_del", **_request_args(request))
            fault_point("sandbox:network-journaled")
            cni_result = await self._cni.add(request, self._config.network.setup_timeout)
            ips, result = cni_result.ips, cni_result.raw
            # DEL must reach the plugins that did the ADD, even if the configuration
            # directory changes meanwhile (a CNI daemonset replacing the bundled network).
            self._journal.amend(sandbox_id, seq, prev_result=result, config=cni_result.config)
            for ip in ips:
                self._ledger.allocate("ip", ip, sandbox_id)
            fault_point("sandbox:network-added")
        if pod_sandbox:
            # After the network: gVisor's netstack takes over the interfaces it finds in
            # the namespace when its sandbox starts. Journaled after CNI DEL, so undone
            # before it: the sandbox lets go of the interfaces before the plugins delete them.
            stage.set(STAGE_POD_SANDBOX)
            await self._start_pause(sandbox_id, sandbox_dir, config, handler, pinned, userns)
        self.rows.mark_ready(sandbox_id, ips, result)
        if self._nri is not None and self._nri.enabled:
            # Last, so that plugins see the pod's IPs; a refusal rolls the pod back.
            stage.set(STAGE_NRI)
            await self._nri.run_pod(pod_of(sandbox_id, config, handler, ips))
            fault_point("sandbox:nri-run")
        stage.set(STAGE_READY)
        fault_point("sandbox:ready")

    async def _start_pause(
        self,
        sandbox_id: str,
        sandbox_dir: Path,
        config: api_pb2.PodSandboxConfig,
        handler: str,
        pinned: PinnedNamespaces,
        userns: UserNamespaceMappings | None,
    ) -> None:
        if self.pause is None:
            raise InvalidArgument(
                "namespace_options.pid: POD (a shared PID namespace) is not available here"
            )
        context = SandboxContext(
            pod_id=sandbox_id,
            hostname=pod_hostname(config, sandbox_id),
            netns_path=pinned.net,
            ipc_ns_path=pinned.ipc,
            uts_ns_path=pinned.uts,
            userns_path=pinned.user,
            userns=userns,
            cgroup_parent=config.linux.cgroup_parent,
        )
        await self.pause.start(sandbox_id, sandbox_dir, config, handler, context)

    def _network_request(
        self, sandbox_id: str, config: api_pb2.PodSandboxConfig, netns: Path
    ) -> PodNetworkRequest:
        ports = [
            {
                "hostPort": pm.host_port,
                "containerPort": pm.container_port,
                "protocol": api_pb2.Protocol.Name(pm.protocol).lower(),
                "hostIP": pm.host_ip,
            }
            for pm in config.port_mappings
            if pm.host_port > 0
        ]
        return PodNetworkRequest(
            pod_id=sandbox_id,
            netns=netns,
            name=config.metadata.name,
            namespace=config.metadata.namespace,
            uid=config.metadata.uid,
            port_mappings=ports,
        )

    def _write_files(
        self, sandbox_id: str, sandbox_dir: Path, config: api_pb2.PodSandboxConfig
    ) -> None:
        dns = config.dns_config
        if dns.servers or dns.searches or dns.options:
            lines = [f"nameserver {s}" for s in dns.servers]
            if dns.searches:
                lines.append("search " + " ".join(dns.searches))
            if dns.options:
                lines.append("options " + " ".join(dns.options))
            resolv = "\n".join(lines) + "\n"
        else:
            # No DNS config from kubelet (crictl, host-network pods): the host's resolver.
            try:
                resolv = Path("/etc/resolv.conf").read_text()
            except OSError:
                resolv = ""
        (sandbox_dir / "resolv.conf").write_text(resolv)
        hostname = pod_hostname(config, sandbox_id)
        (sandbox_dir / "hostname").write_text(hostname + "\n")
        (sandbox_dir / "hosts").write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"127.0.1.1\t{hostname}\n"
        )

    # ---- undo actions --------------------------------------------------------------

    async def _undo_cni(self, args: dict[str, Any]) -> None:
        request = PodNetworkRequest(
            pod_id=args["pod_id"],
            netns=Path(args["netns"]),
            name=args["name"],
            namespace=args["namespace"],
            uid=args["uid"],
            port_mappings=args["port_mappings"],
        )
        await self._cni.delete(
            request,
            self._config.network.teardown_timeout,
            prev_result=args.get("prev_result"),
            config=args.get("config"),
        )
        # Only now is the address free: the plugin has given it back.
        self._ledger.release(args["pod_id"], "ip")

    async def _undo_unpin(self, args: dict[str, Any]) -> None:
        await self.pinner.unpin(Path(args["path"]))
        self._ledger.release_value("path", args["path"])

    async def _undo_unmount(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(mounts.unmount, Path(args["path"]))

    async def _undo_remove_dir(self, args: dict[str, Any]) -> None:
        path = Path(args["path"])
        # A mount left inside would make rmtree delete a live filesystem's files.
        await asyncio.to_thread(mounts.unmount_below, path)
        await asyncio.to_thread(shutil.rmtree, path, True)

    # ---- published ----------------------------------------------------------------

    def _announce(self, object_id: str) -> None:
        # kubelet's evented PLEG learns of a pod through its sandbox's own events, as
        # containerd and CRI-O report their infra containers: created, then running.
        self.events.emit(object_id, object_id, CONTAINER_CREATED)
        self.events.emit(object_id, object_id, CONTAINER_STARTED)

    # ---- Stop / Remove -------------------------------------------------------------

    async def stop(self, sandbox_ref: str) -> None:
        sandbox = self.find(sandbox_ref)
        if sandbox is None:
            return  # kubelet retries stop for pods it forgot about; unknown is success
        await self._containers.stop_all_in(sandbox.id)
        try:
            await self._journal.undo(
                sandbox.id, only=_STOP_ACTIONS, budget=self._config.network.teardown_timeout
            )
        except UndoFailed as exc:
            # The steps are queued for garbage collection; the pod is stopped all the same.
            log.error("sandbox %s (%s): stop left work for GC: %s", sandbox.id, sandbox.name, exc)
        self.mark_not_ready(sandbox.id)
        log.info("sandbox %s (%s) stopped", sandbox.id, sandbox.name)

    async def remove(self, sandbox_ref: str) -> None:
        sandbox = self.find(sandbox_ref)
        if sandbox is None:
            return
        await self._containers.remove_all_in(sandbox.id)
        try:
            await self._journal.undo(sandbox.id, budget=self._config.creation.cleanup_timeout)
        except UndoFailed as exc:
            log.error(
                "sandbox %s (%s): removal left work for GC: %s", sandbox.id, sandbox.name, exc
            )
        # Before the rows go: the event carries the pod's last status.
        self.events.emit(sandbox.id, sandbox.id, CONTAINER_DELETED)
        self.rows.forget(sandbox.id)
        self.coordinator.release(sandbox.name, object_id=sandbox.id)
        log.info("sandbox %s (%s) removed", sandbox.id, sandbox.name)

    # ---- queries (visible sandboxes only) ------------------------------------------

    def find(self, ref: str) -> SandboxRecord | None:
        return self.pods.find(ref)

    def get(self, ref: str) -> SandboxRecord:
        return self.pods.get(ref)

    def list(self) -> list[SandboxRecord]:
        return self.pods.list()

    def ids(self) -> set[str]:
        """Every sandbox with a row, whatever its phase."""
        return self.pods.rows.ids()

    # ---- restore -------------------------------------------------------------------

    async def restore(self) -> None:
        """Before serving: roll back interrupted creations, re-register the rest."""
        await restore_creations(
            self.rows, self.coordinator, self._journal, self._config.creation.cleanup_timeout
        )

    def notice_exit(self, sandbox_id: str | None) -> None:
        """An exit file appeared (None: some may have been missed). When it is the pause
        process of a ready pod, the pod has lost its PID namespace and every process in
        it: it is not ready any more, and kubelet will recreate it."""
        if self.pause is None:
            return
        if sandbox_id is None:
            sandboxes = self.list()
        else:
            visible = self.rows.visible(sandbox_id)
            sandboxes = [visible] if visible is not None else []
        for sandbox in sandboxes:
            if sandbox.ready and self.pause.exited(sandbox):
                log.warning(
                    "sandbox %s (%s): its pause process exited; the pod is not ready",
                    sandbox.id,
                    sandbox.name,
                    extra=object_fields("sandbox", sandbox.id, sandbox.name),
                )
                self.mark_not_ready(sandbox.id)

    def mark_not_ready(self, sandbox_id: str) -> None:
        if self.rows.mark_not_ready(
            sandbox_id
        ):  # one event per transition, whoever noticed it first
            self.events.emit(sandbox_id, sandbox_id, CONTAINER_STOPPED)

    def network_status(self) -> tuple[bool, str, str]:
        return self._cni.status()

    def reload_network(self) -> None:
        """Re-read the CNI configuration now (SIGHUP, `systemctl reload`)."""
        self._cni.reload()


def _request_args(request: PodNetworkRequest) -> dict[str, Any]:
    return {
        "pod_id": request.pod_id,
        "netns": str(request.netns),
        "name": request.name,
        "namespace": request.namespace,
        "uid": request.uid,
        "port_mappings": request.port_mappings,
    }
