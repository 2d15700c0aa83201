"""The relay from the socket systemd passed (server/activation.py) to the gRPC server's
private socket (server/unix_socket.py `bind_private_socket`).

grpcio cannot serve on a listening descriptor it did not bind, so the daemon relays:
each connection accepted on the activated socket is joined to one of its own to the
private socket, bytes copied both ways. The relay accepts from the daemon's start on and
answers each connection's HTTP/2 handshake itself (server/http2_drain.py says why); the
connections are joined to the gRPC server, and their calls forwarded, only once the state
is restored and the server serves (DESIGN §3). On stop, the calls forwarded are answered
and the later ones held back; the relay goes on accepting, answering handshakes and
holding calls, until the very end of the stop, and then tells each client (GOAWAY,
server/http2_drain.py) to retry its held calls on a new connection. Those wait in the
kernel's backlog of the socket systemd keeps open only while this process exits and the
next one starts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from cri_shim.transport.http2_drain import (
    ClientToServer,
    OpenStreams,
    ServerToClient,
    goaway_frame,
    settings_frame,
)

log = logging.getLogger("cri_shim.server.relay")

# How often a stopping daemon looks whether the last forwarded calls are answered.
ANSWERED_POLL = 0.005


def _same(end: _End) -> _End:
    return end


class _End(asyncio.Protocol):
    """One end of a relayed connection: what it receives is written, through `feed`, to
    the other end, in the callback that received it (no task in between: a call pays
    for the relay with two socket writes, not with trips through the event loop)."""

    def __init__(
        self,
        feed: Callable[[bytes], bytes],
        lost: Callable[[], None],
        made: Callable[[], None] | None = None,
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _End | None = None
        self.ended = False  # this end was told the other ended (EOF): nothing more to send
        self.passes_end = True  # its EOF and its close are passed on to the other end
        self._feed = feed
        self._lost = lost
        self._made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._made is not None:
            self._made()

    def send(self, data: bytes) -> None:
        if data and self.transport is not None and not (self.ended or self.transport.is_closing()):
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.other is not None:
            self.other.send(self._feed(data))

    def eof_received(self) -> bool:
        # A half-close is passed on; the other direction stays open for the answers
        # still to come.
        other = self.other
        if not self.passes_end:
            return False  # this end closes; the other stays open
        if other is not None and other.transport is not None and not other.ended:
            if other.transport.can_write_eof() and not other.transport.is_closing():
                other.ended = True
                other.transport.write_eof()
        return True

    # Back-pressure: a full buffer towards one end stops reading from the other.
    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.passes_end and self.other is not None and self.other.transport is not None:
            self.other.transport.close()
        self._lost()


class RelayedConnection:
    """One client's connection and the daemon's connection it is joined to."""

    def __init__(
        self,
        accepted: Callable[[RelayedConnection], None],
        forget: Callable[[RelayedConnection], None],
    ) -> None:
        self.streams = OpenStreams()
        self.inbound = ClientToServer(self.streams)
        self.outbound = ServerToClient(self.streams)
        self.client = _End(self.inbound.feed, lambda: forget(self), lambda: accepted(self))
        self.server = _End(self.outbound.feed, lambda: None)
        self.client.other, self.server.other = self.server, self.client
        self.preface_sent = False

    async def join(self, upstream: Path) -> None:
        """Connect to the gRPC server, then let the client's bytes flow (its end does
        not read until then)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.create_unix_connection(lambda: self.server, str(upstream))
        except OSError as exc:
            log.warning("relay: cannot reach the gRPC server at %s: %s", upstream, exc)
            self.close()
            return
        if self.client.transport is not None and not self.client.transport.is_closing():
            self.client.transport.resume_reading()

    def answer_preface(self) -> None:
        """The server's half of HTTP/2's connection preface, sent to the client at once
        (unless the early acceptor sent it): it may then send its calls, which wait here
        until the connection is joined."""
        self.inbound.preface_answered()
        if not self.preface_sent:
            self.preface_sent = True
            self.client.send(settings_frame())

    def hold(self) -> None:
        """Forward none of the streams the client opens from now on, and keep the client
        from learning that the server stops (its GOAWAY, its close): the client is told
        once, at the end (go_away), and retries those streams then. A gRPC client retries
        a call only once so: told twice, by the server and again by the stopping relay
        that took its new connection, it would fail the call UNAVAILABLE."""
        self.inbound.drain()
        self.outbound.holding = True
        self.server.passes_end = False

    def go_away(self) -> None:
        """Tell the client that no stream after the last one forwarded was served here
        (GOAWAY): it retries those on a new connection."""
        self.hold()
        last = self.inbound.last_stream_id
        self.client.send(self.outbound.insert(goaway_frame(last, b"cri-shim is restarting")))

    def close(self) -> None:
        for end in (self.client, self.server):
            if end.transport is not None:
                end.transport.close()


class SocketRelay:
    """Accepts on the activated socket once started, and joins the connections to the
    gRPC server at `upstream` once told it serves; owns every relayed connection."""

    def __init__(self, listening: socket.socket) -> None:
        self._listening = listening
        self._upstream: Path | None = None
        self._serving = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._connections: set[RelayedConnection] = set()
        self._joining: set[asyncio.Task[None]] = set()
        self._draining = False

    @property
    def connections(self) -> frozenset[RelayedConnection]:
        """The connections accepted and not yet closed."""
        return frozenset(self._connections)

    async def start(self, answered: list[socket.socket] | None = None) -> None:
        """Accept from now on: each connection is answered its handshake, and waits.
        `answered`: connections accepted already, their preface sent (EarlyAcceptor)."""
        loop = asyncio.get_running_loop()
        for accepted in answered or []:
            accepted.setblocking(False)
            end = self._new_connection(preface_sent=True).client
            await loop.connect_accepted_socket(functools.partial(_same, end), sock=accepted)
        self._server = await loop.create_unix_server(self._accepted, sock=self._listening)

    def serve(self, upstream: Path) -> None:
        """The gRPC server serves at `upstream`: join the connections to it."""
        self._upstream = upstream
        self._serving.set()

    def _new_connection(self, preface_sent: bool = False) -> RelayedConnection:
        connection = RelayedConnection(self._join, self._connections.discard)
        connection.preface_sent = preface_sent
        self._connections.add(connection)
        return connection

    def _accepted(self) -> asyncio.Protocol:
        return self._new_connection().client

    def _join(self, connection: RelayedConnection) -> None:
        """The client's end is made: its handshake is answered, and it reads nothing
        until joined to the gRPC server."""
        assert connection.client.transport is not None
        connection.answer_preface()
        connection.client.transport.pause_reading()
        if self._draining:  # accepted while the daemon stops: held until aclose
            connection.hold()
            return
        task = asyncio.create_task(self._join_when_serving(connection))
        self._joining.add(task)
        task.add_done_callback(self._joining.discard)

    async def _join_when_serving(self, connection: RelayedConnection) -> None:
        await self._serving.wait()
        assert self._upstream is not None
        await connection.join(self._upstream)

    def drain(self) -> None:
        """Forward no new call: every connection is held, and so are those accepted
        from now on, answered their handshake (a gRPC client closes a connection left
        unanswered 5 s, failing its calls; the daemon's stop and the next one's start
        may take longer), until aclose tells them all to go."""
        self._draining = True
        for connection in self._connections:
            connection.hold()

    async def answered(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every stream forwarded before the
        drain has been answered; False if some were not by then."""
        deadline = asyncio.get_running_loop().time() + timeout
        while any(connection.streams.ids for connection in self._connections):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(ANSWERED_POLL)
        return True

    async def aclose(self) -> None:
        """At the end of the stop, the gRPC server stopped: accept no more (connections
        wait in the backlog for the next daemon: systemd keeps the socket open), tell
        every client which of its calls were served (GOAWAY; it retries the others on a
        new connection) and close."""
        self.drain()
        if self._server is not None:
            # Closes this process's descriptor only; the socket stays systemd's.
            self._server.close()
        for task in self._joining:
            task.cancel()
        await asyncio.gather(*self._joining, return_exceptions=True)
        for connection in list(self._connections):
            connection.go_away()
            connection.close()
        self._server = None
