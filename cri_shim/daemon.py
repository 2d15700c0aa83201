"""The daemon: builds the graph, restores state, then serves gRPC on the unix socket.

Order matters: the state is restored and reconciled with the host *before* the socket is
bound, so that no request ever sees a half-restored view (a partial ListPodSandbox would
make kubelet start pods again at attempt 0).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable

import grpc

from cri_shim import logcontext
from cri_shim.composition import Graph, build_graph
from cri_shim.config import Config
from cri_shim.errors import Internal, Unavailable
from cri_shim.host.heap import limit_arenas, map_large_blocks
from cri_shim.host.process import set_child_subreaper
from cri_shim.host.sd_notify import SystemdNotifier
from cri_shim.host.systemd_manager import SystemdManager
from cri_shim.lifecycle.events import ExitWatcher
from cri_shim.lifecycle.reconcile import reconcile_host, undo_orphan_journals
from cri_shim.metrics import MetricsExporter
from cri_shim.runtime.orphans import OrphanReaper
from cri_shim.server.listing import reply_limit
from cri_shim.server.services import ImageService, RuntimeService, add_to_server
from cri_shim.server.views import ObjectNames
from cri_shim.transport.activation import EarlyAcceptor
from cri_shim.transport.relay import SocketRelay
from cri_shim.transport.unix_socket import (
    bind_private_socket,
    bind_unix_socket,
    private_socket_dir,
)

log = logging.getLogger("cri_shim.daemon")

SWITCH_INTERVAL = 0.0005

# Event streams (GetContainerEvents) take no admission slot; room for that many.
STREAM_HEADROOM = 64


def bind_exited_object(names: ObjectNames, object_id: str) -> None:
    """An exit file is named for a container, or for a pod's pause process."""
    for kind in ("container", "sandbox"):
        if (known := names.identify(kind, object_id)) is not None:
            logcontext.bind_object(kind, *known)
            return


async def restore(graph: Graph) -> None:
    started = time.monotonic()
    await graph.sandboxes.restore()
    await undo_orphan_journals(
        graph.journal,
        graph.sandboxes.rows.ids() | graph.containers.rows.ids(),
        graph.config.creation.cleanup_timeout,
    )
    await graph.containers.restore()
    orphans = await reconcile_host(
        graph.sandboxes,
        graph.containers,
        graph.sandboxes.pinner,
        graph.config.root,
    )
    if orphans:
        log.warning("reconciliation removed or corrected %d orphan(s)", orphans)
    queued = await graph.journal.collect_garbage()
    if queued:
        log.warning("%d cleanup step(s) still queued for garbage collection", queued)
    log.info(
        "state restored in %.3fs: %d sandboxes, %d containers",
        time.monotonic() - started,
        len(graph.sandboxes.list()),
        len(graph.containers.list()),
    )


class Daemon:
    def __init__(
        self,
        config: Config,
        acceptor: EarlyAcceptor | None = None,
        systemd: SystemdNotifier | None = None,
    ) -> None:
        self.config = config
        self.runtime_service = RuntimeService()
        self.image_service = ImageService()
        self.graph: Graph | None = None
        self._server: grpc.aio.Server | None = None
        self._stopping = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._metrics: MetricsExporter | None = None
        # READY=1 went out already when systemd passed the socket (cli.py): the start
        # job ends once the socket is answered, and the status says when calls are served.
        self.systemd = systemd if systemd is not None else SystemdNotifier()
        # The CRI socket systemd holds (cri-shim.socket), found by the command before the
        # daemon's modules load (cli.py: a socket that cannot be the configured one stops
        # the start there) and accepted on from then; its calls are served once the
        # restore is done (_bind). None: the daemon binds the socket itself.
        self._acceptor = acceptor
        self._relay: SocketRelay | None = None

    async def start(self) -> None:
        # A worker thread busy in Python (checking a large request, walking a layer)
        # holds the interpreter until the switch interval ends, and the event loop waits
        # that long each time it gives the interpreter up for a system call: half a
        # millisecond rather than Python's five keeps the loop's waits short.
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            set_child_subreaper()  # reap our own orphans at once (DESIGN §5)
        except OSError as exc:
            log.warning("%s", exc)
        if self._acceptor is not None:
            # The relay takes over the connections accepted early and accepts from now on,
            # answering HTTP/2's handshake at once (a gRPC client closes a connection left
            # unanswered 5 s); their calls wait in the relay until the restore is done.
            self._relay = SocketRelay(self._acceptor.listening)
            early = self._acceptor.take()
            await self._relay.start(early)
            log.info(
                "socket activation: %d connection(s) accepted early; calls wait for the restore",
                len(early),
            )
        graph = build_graph(self.config)
        await restore(graph)
        # What each runtime handler supports, probed once off the event loop (Status and
        # CreateContainer read it from then on).
        await asyncio.to_thread(
            lambda: [b.kind.features() for b in graph.containers.backends.values()]
        )
        # The CNI configuration read now: a network that cannot be used (a broken file, a
        # subnet the host routes elsewhere) is logged at start, not at the first Status.
        graph.sandboxes.network_status()
        if graph.nri is not None and graph.nri.adaptation is not None:
            # After restore, so that a plugin is synchronized with the whole state.
            await graph.nri.adaptation.start()
        # Orphans re-parented to us (we are a subreaper) must be reaped, or a zombie in a
        # container's PID namespace keeps `runc delete` failing.
        self._background.add(asyncio.create_task(OrphanReaper().run(), name="orphan-reaper"))
        # The WAL is copied into the database off the loop (state/db.py), not by a commit.
        checkpoints = graph.db.checkpoint_periodically()
        self._background.add(asyncio.create_task(checkpoints, name="db-checkpoint"))
        # What malloc holds free after a burst (gRPC's and protobuf's buffers) goes back
        # to the kernel rather than staying resident (host/heap.py).
        self._background.add(asyncio.create_task(graph.heap.run(), name="heap-trimmer"))
        if graph.census.loop_monitor is not None:
            monitor = graph.census.loop_monitor.run()
            self._background.add(asyncio.create_task(monitor, name="loop-monitor"))
        # Exits noticed as conmon writes them, so that GetContainerEvents streams a stopped
        # event when it happens, not when someone next lists or asks for a status.

        def exited(name: str | None) -> None:
            with logcontext.scope():
                if name is not None:
                    bind_exited_object(graph.names, name)
                graph.containers.notice_exit(name)
                graph.sandboxes.notice_exit(name)  # a pod's pause process

        watcher = ExitWatcher(
            [backend.exits_dir for backend in graph.containers.backends.values()], exited
        )
        self._background.add(asyncio.create_task(watcher.run(), name="exit-watcher"))
        # An exit between restore and the watch being in place would go unnoticed.
        exited(None)
        self.graph = graph
        self.runtime_service.view = graph.runtime_view
        self.image_service.view = graph.image_view
        # Metrics: the census is read at scrape time; the HTTP endpoint
        # runs only when [metrics] listen is set, and is closed in stop().
        if graph.metrics is not None:
            self._metrics = MetricsExporter(graph.census, graph.metrics, self.config.metrics.listen)
            await self._metrics.start()
        await self._bind()
        # What start made lives as long as the daemon: kept out of the collector's full
        # passes, which hold the loop for as long as they walk the heap.
        gc.freeze()
        log.info("serving CRI on %s", self.config.listen)
        self.systemd.ready("serving")

    async def _bind(self) -> None:
        limits = self.config.requests
        server = grpc.aio.server(
            options=[
                # A bigger request is refused (RESOURCE_EXHAUSTED) before it is parsed.
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                # The list RPCs refuse a bigger reply themselves, naming their stream.
                ("grpc.max_send_message_length", reply_limit(self.config)),
            ],
            # A backstop behind the admission limits (server/limits.py), which refuse
            # first and with a better message: no flood can hold unbounded memory.
            maximum_concurrent_rpcs=limits.max_in_flight
            + limits.max_queued
            + limits.max_reads_in_flight
            + STREAM_HEADROOM,
        )
        add_to_server(server, self.runtime_service, self.image_service)
        if self._relay is not None:
            await self._serve_activated(server, self._relay)
            return
        # Mode 0660, group socket_group, in a directory only root writes: whoever reaches
        # the socket can run anything as root on the node.
        bind_unix_socket(server, self.config.socket_path, self.config.socket_group)
        await server.start()
        self._server = server

    async def _serve_activated(self, server: grpc.aio.Server, relay: SocketRelay) -> None:
        """gRPC on a private socket, the socket systemd passed relayed to it: the
        relay's connections are joined to it from now on, and their calls served."""
        if self.config.socket_group:
            log.warning(
                "socket_group %r does not apply to the socket systemd passed: its group "
                "is the socket unit's SocketGroup= (systemctl edit cri-shim.socket)",
                self.config.socket_group,
            )
        private = bind_private_socket(server, self.config.socket_path)
        await server.start()
        self._server = server
        relay.serve(private)

    def request_stop(self) -> None:
        self._stopping.set()

    async def wait(self) -> None:
        await self._stopping.wait()

    async def stop(self) -> None:
        self.systemd.notify("STOPPING=1")
        if self.graph is not None:
            self.graph.sandboxes.events.close()
        if self._relay is not None:
            # New calls are held, for the next daemon (relay.aclose, last); the calls
            # forwarded already are answered before gRPC's server stops (which would
            # cancel those it had not yet taken up). A stop that takes the socket with it
            # has no next daemon to wait for: the calls in flight get gRPC's STOP_GRACE
            # only, as where the daemon binds its socket itself.
            self._relay.drain()
            if await self._socket_stops():
                log.info("the socket stops with the daemon: calls in flight get %.0fs", STOP_GRACE)
            elif not await self._relay.answered(DRAIN_TIMEOUT):
                log.warning("stopping with calls not answered within %.0fs", DRAIN_TIMEOUT)
        if self._server is not None:
            await self._server.stop(grace=STOP_GRACE)
        if self._relay is not None:
            shutil.rmtree(private_socket_dir(self.config.socket_path), ignore_errors=True)
        elif self._server is not None:
            # gRPC removes the path it bound, which was renamed into place (unix_socket.py).
            self.config.socket_path.unlink(missing_ok=True)
        try:
            await self._release()
        finally:
            if self._relay is not None:
                # Last: until now the relay answered new connections' handshakes and held
                # their calls; the clients are told to retry those, and their connections
                # wait in systemd's socket only until the next daemon starts (a gRPC client
                # closes one left unanswered 5 s, failing its calls).
                await self._relay.aclose()
        log.info("stopped")

    async def _socket_stops(self) -> bool:
        assert self._acceptor is not None
        systemd = SystemdManager(connect_timeout=QUERY_TIMEOUT, call_timeout=QUERY_TIMEOUT)
        try:
            return await socket_stops(self._acceptor.unit, systemd)
        finally:
            await systemd.close()

    async def _release(self) -> None:
        """What the daemon holds besides its sockets, let go once its server stopped."""
        if self._metrics is not None:
            await self._metrics.aclose()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.graph is not None:
            # The next start adopts the conmons; a death being handled finishes first.
            await self.graph.monitors.aclose()
            self.graph.oom_watch.close()
            if self.graph.nri is not None:
                await self.graph.nri.close()
                if self.graph.nri.adaptation is not None:
                    await self.graph.nri.adaptation.stop()
            await self.graph.streaming.aclose()
            await self.graph.puller.aclose()
            await self.graph.sandboxes.coordinator.aclose()
            await self.graph.containers.coordinator.aclose()
            # What the spans queue still holds, exported within a bounded wait.
            await asyncio.to_thread(self.graph.tracer.shutdown, TRACE_FLUSH_TIMEOUT)
            self.graph.db.close()


# How long a stopping daemon lets the calls in flight finish.
STOP_GRACE = 5.0
# Behind an activated socket, how long the calls forwarded before the stop get to be
# answered, new ones going to the next daemon: a pod's creation under load takes seconds.
# (Event streams end at once: stop() closes them first.) Within systemd's stop timeout.
DRAIN_TIMEOUT = 30.0
# How long a stopping daemon waits for its last spans to reach the collector.
TRACE_FLUSH_TIMEOUT = 2.0
# How long a stopping daemon behind an activated socket gives systemd to say whether the
# socket stops too (each of the connection and its calls).
QUERY_TIMEOUT = 2.0


async def socket_stops(unit: str, systemd: SystemdManager) -> bool:
    """Whether systemd stops the activated socket `unit` once this daemon has stopped,
    rather than keeping it for the next one: `systemctl stop cri-shim` (the service's
    PropagatesStopTo= queues the socket's stop with its own) and `systemctl stop
    cri-shim.socket` do; a restart does not. Where systemd cannot tell, the socket is
    taken to stay (the longer wait, a restart's)."""
    if not unit.endswith(".socket"):
        return False  # a name the socket unit set (FileDescriptorName=): no unit to ask
    try:
        return await systemd.queued_job(unit) == "stop"
    except (Unavailable, Internal) as err:
        log.info("could not ask systemd whether %s stops: %s", unit, err)
        return False


def reload_network(daemon: Daemon) -> None:
    """SIGHUP (`systemctl reload`): re-read the CNI configuration in place, so that the
    next pods use a network installed or changed since the start without a restart."""
    if daemon.graph is None:
        log.info("SIGHUP while restoring: ignored, the configuration is read at start")
        return
    log.info("SIGHUP: re-reading the CNI configuration")
    daemon.graph.sandboxes.reload_network()


async def serve(
    config: Config,
    acceptor: EarlyAcceptor | None = None,
    systemd: SystemdNotifier | None = None,
    stopped_early: Callable[[], bool] = lambda: False,
) -> None:
    # Before gRPC's threads start: each thread that finds the arenas busy would otherwise
    # get one of its own, up to eight per core, each keeping its free memory.
    limit_arenas()
    # A reply of megabytes (its bytes, gRPC core's copy) goes back to the kernel when the
    # reply is let go, not to the heap (server/limits.py).
    map_large_blocks()
    daemon = Daemon(config, acceptor, systemd)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    # Registered before start(): SIGHUP's default action would kill a restoring daemon.
    loop.add_signal_handler(signal.SIGHUP, reload_network, daemon)
    if stopped_early():  # SIGTERM came while the modules loaded (cli.py)
        daemon.request_stop()
    await daemon.start()
    try:
        await daemon.wait()
    finally:
        await daemon.stop()
