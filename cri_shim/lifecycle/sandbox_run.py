"""RunPodSandbox: the sandbox's creation steps, their undo actions, and the publication.

There is no infra container. A sandbox is a directory (resolv.conf, hostname, hosts, a
per-pod /dev/shm), pinned network/UTS/IPC namespaces, and a CNI attachment. Each step
records its inverse in the undo journal before it acts, so that a failure, an expiry, a
removal and a restart all undo the same way.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cri_shim import tracing
from cri_shim.api.v1 import api_pb2
from cri_shim.config import Config
from cri_shim.creation.coordinator import Stage
from cri_shim.creation.names import sandbox_name
from cri_shim.errors import InvalidArgument
from cri_shim.faults import fault_point
from cri_shim.host import mounts
from cri_shim.host.idmap import UserNamespaceMappings
from cri_shim.lifecycle.events import CONTAINER_CREATED, CONTAINER_STARTED, EventBus
from cri_shim.lifecycle.pause import SandboxContainers, shares_pid_namespace
from cri_shim.lifecycle.persisted_creation import persisted_coordinator
from cri_shim.lifecycle.pods import PodContainers
from cri_shim.lifecycle.resource_rules import check_pod_resources
from cri_shim.network.cni import CniNetwork, PodNetworkRequest
from cri_shim.network.netns import USERNS_DIR, NamespacePinner, PinnedNamespaces
from cri_shim.pod_rules import check_pod_sysctls, host_network, pod_hostname
from cri_shim.runtime.cgroup_driver import driver_named
from cri_shim.runtime.features import HandlerFeatures, require_pod_features
from cri_shim.runtime.spec import SandboxContext
from cri_shim.runtime.userns import pod_mappings, require_searchable
from cri_shim.state.journal import Journal
from cri_shim.state.ledger import Ledger
from cri_shim.state.sandboxes import SandboxRepository

if TYPE_CHECKING:
    from cri_shim.nri.hooks import NriHooks

STAGE_STORAGE = "sandbox storage"
STAGE_NAMESPACES = "sandbox namespaces"
STAGE_PID_NAMESPACE = "sandbox pid namespace"
STAGE_NETWORK = "sandbox network"
STAGE_POD_SANDBOX = "sandbox container"
STAGE_NRI = "sandbox NRI plugins"
STAGE_READY = "sandbox ready"

SHM_SIZE = 64 * 1024 * 1024


class SandboxRun:
    """Runs each sandbox's creation under the creation contract (its coordinator)."""

    def __init__(
        self,
        config: Config,
        rows: SandboxRepository,
        journal: Journal,
        ledger: Ledger,
        pinner: NamespacePinner,
        cni: CniNetwork,
        *,
        events: EventBus,
        containers: PodContainers,
        handler_features: Callable[[str], HandlerFeatures],
        pause: SandboxContainers | None,
        nri: NriHooks | None,
        tracer: tracing.Tracer = tracing.NO_TRACER,
    ) -> None:
        self._config = config
        self._rows = rows
        self._journal = journal
        self._ledger = ledger
        self._pinner = pinner
        self._cni = cni
        self._events = events
        # What each runtime handler supports (the container lifecycle owns the handlers).
        self._handler_features = handler_features
        # The PID 1 of pods that share one PID namespace; None refuses such pods.
        self._pause = pause
        self._nri = nri
        self._dir = config.root / "sandboxes"
        self.coordinator = persisted_coordinator(
            "sandbox",
            rows,
            journal,
            config.creation,
            published=self.announce,
            # A pod's containers go before the pod's own steps are undone.
            before_undo=containers.remove_all_in,
            tracer=tracer,
        )
        self._cgroup_driver = driver_named(config.cgroup_manager)
        journal.register("cni_del", self._undo_cni)
        journal.register("unpin", self._undo_unpin)
        journal.register("unmount", self._undo_unmount)
        journal.register("remove_dir", self._undo_remove_dir)

    async def run(
        self, config: api_pb2.PodSandboxConfig, runtime_handler: str, deadline: float | None
    ) -> str:
        meta = config.metadata
        for field in ("name", "uid", "namespace"):
            if not getattr(meta, field):
                raise InvalidArgument(f"PodSandboxConfig.metadata.{field} must not be empty")
        check_pod_sysctls(config)
        linux = config.linux
        await asyncio.to_thread(
            check_pod_resources, linux.overhead, linux.resources, "PodSandboxConfig.linux"
        )
        handler = runtime_handler or self._config.runtime.default_handler
        if handler not in self._config.runtime.handlers:
            known = ", ".join(sorted(self._config.runtime.handlers))
            raise InvalidArgument(f"unknown runtime handler {handler!r} (configured: {known})")
        # A parent of the other driver's form: refused before anything is made (kubelet
        # and the runtime would otherwise each manage the pod's cgroups their own way).
        self._cgroup_driver.check_parent(
            config.linux.cgroup_parent, "PodSandboxConfig.linux.cgroup_parent"
        )
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
        """The creation's steps in order: storage, namespaces, the pause process of a pod
        sharing its PID namespace, the network, the sandbox container of a handler whose
        pods are sandboxes, NRI. Each journals its undo before it acts and has a fault
        point that the crash tests kill the daemon at."""
        sandbox_dir = self._dir / sandbox_id
        shm = sandbox_dir / "shm"
        stage.set(STAGE_STORAGE)
        # The row comes first: everything after it is a side effect that a crash may
        # interrupt, and restore finds interrupted creations through this row. It is
        # committed with the undo of the storage steps, which may run before those steps
        # did (an unmount of what is not mounted, the removal of a missing directory).
        with self._journal.batch():
            self._rows.insert(sandbox_id, name, STAGE_STORAGE, handler, config, sandbox_dir)
            self._journal.record(sandbox_id, "remove_dir", path=str(sandbox_dir))
            self._journal.record(sandbox_id, "unmount", path=str(shm))
        fault_point("sandbox:row")
        sandbox_dir.mkdir(parents=True, exist_ok=True)
        _write_files(sandbox_id, sandbox_dir, config)
        if config.log_directory:
            os.makedirs(config.log_directory, exist_ok=True)
        fault_point("sandbox:files")
        shm.mkdir(exist_ok=True)
        mounts.mount_tmpfs(shm, size=SHM_SIZE, mode=0o1777)
        fault_point("sandbox:shm")

        stage.set(STAGE_NAMESPACES)
        pinned = await self._pin_namespaces(sandbox_id, config, userns)

        pod_sandbox = self._pause is not None and self._pause.is_pod_sandbox(handler)
        if shares_pid_namespace(config) and not pod_sandbox:
            stage.set(STAGE_PID_NAMESPACE)
            await self._start_pause(sandbox_id, sandbox_dir, config, handler, pinned, userns)

        ips: list[str] = []
        result: dict[str, Any] | None = None
        if pinned.net is not None:
            stage.set(STAGE_NETWORK)
            ips, result = await self._attach_network(sandbox_id, config, pinned.net)
        if pod_sandbox:
            # After the network: gVisor's netstack takes over the interfaces it finds in
            # the namespace when its sandbox starts. Journaled after CNI DEL, so undone
            # before it: the sandbox lets go of the interfaces before the plugins delete them.
            stage.set(STAGE_POD_SANDBOX)
            await self._start_pause(sandbox_id, sandbox_dir, config, handler, pinned, userns)
        self._rows.mark_ready(sandbox_id, ips, result)
        if self._nri is not None and self._nri.enabled:
            from cri_shim.nri.objects import pod_of

            # Last, so that plugins see the pod's IPs; a refusal rolls the pod back.
            stage.set(STAGE_NRI)
            await self._nri.run_pod(pod_of(sandbox_id, config, handler, ips))
            fault_point("sandbox:nri-run")
        stage.set(STAGE_READY)
        fault_point("sandbox:ready")

    async def _pin_namespaces(
        self,
        sandbox_id: str,
        config: api_pb2.PodSandboxConfig,
        userns: UserNamespaceMappings | None,
    ) -> PinnedNamespaces:
        """The pod's namespaces, each pinned as a file; every pin's path is handed out
        in the ledger and its unpin journaled before the pinning starts."""
        options = config.linux.security_context.namespace_options
        hostnet = host_network(config)
        with self._journal.batch():  # one commit for them all
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
        pinned = await self._pinner.pin(
            sandbox_id,
            net=not hostnet,
            uts=not hostnet,
            ipc=options.ipc != api_pb2.NODE,
            hostname=pod_hostname(config, sandbox_id),
            userns=userns,
        )
        self._rows.set_namespaces(
            sandbox_id, net=pinned.net, ipc=pinned.ipc, uts=pinned.uts, user=pinned.user
        )
        fault_point("sandbox:namespaces")
        return pinned

    async def _start_pause(
        self,
        sandbox_id: str,
        sandbox_dir: Path,
        config: api_pb2.PodSandboxConfig,
        handler: str,
        pinned: PinnedNamespaces,
        userns: UserNamespaceMappings | None,
    ) -> None:
        if self._pause is None:
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
            cgroup_driver=self._cgroup_driver,
        )
        await self._pause.start(sandbox_id, sandbox_dir, config, handler, context)

    async def _attach_network(
        self, sandbox_id: str, config: api_pb2.PodSandboxConfig, netns: Path
    ) -> tuple[list[str], dict[str, Any]]:
        """CNI ADD in the pinned network namespace; the pod's IPs and the plugins' result."""
        request = _network_request(sandbox_id, config, netns)
        # DEL is journaled before ADD: a plugin may allocate an address and then fail,
        # and only a DEL gives that address back.
        seq = self._journal.record(sandbox_id, "cni_del", **_request_args(request))
        fault_point("sandbox:network-journaled")
        added = await self._cni.add(request, self._config.network.setup_timeout)
        # DEL must reach the plugins that did the ADD, even if the configuration
        # directory changes meanwhile (a CNI daemonset replacing the bundled network).
        with self._journal.batch():
            self._journal.amend(sandbox_id, seq, prev_result=added.raw, config=added.config)
            for ip in added.ips:
                self._ledger.allocate("ip", ip, sandbox_id)
        fault_point("sandbox:network-added")
        return added.ips, added.raw

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
        await self._pinner.unpin(Path(args["path"]))
        self._ledger.release_value("path", args["path"])

    async def _undo_unmount(self, args: dict[str, Any]) -> None:
        await asyncio.to_thread(mounts.unmount, Path(args["path"]))

    async def _undo_remove_dir(self, args: dict[str, Any]) -> None:
        path = Path(args["path"])
        await asyncio.to_thread(mounts.remove_tree, path)

    # ---- published ----------------------------------------------------------------

    def announce(self, object_id: str) -> None:
        # kubelet's evented PLEG learns of a pod through its sandbox's own events, as
        # containerd and CRI-O report their infra containers: created, then running.
        self._events.emit(object_id, object_id, CONTAINER_CREATED)
        self._events.emit(object_id, object_id, CONTAINER_STARTED)


def _write_files(sandbox_id: str, sandbox_dir: Path, config: api_pb2.PodSandboxConfig) -> None:
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
        f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
    )


def _network_request(
    sandbox_id: str, config: api_pb2.PodSandboxConfig, netns: Path
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


def _request_args(request: PodNetworkRequest) -> dict[str, Any]:
    return {
        "pod_id": request.pod_id,
        "netns": str(request.netns),
        "name": request.name,
        "namespace": request.namespace,
        "uid": request.uid,
        "port_mappings": request.port_mappings,
    }
