"""The relay from the socket systemd passed (transport/activation.py) to the gRPC server's
private socket (transport/unix_socket.py `bind_private_socket`).

grpcio cannot serve on a listening descriptor it did not bind, so the daemon relays:
each connection accepted on the activated socket is joined to one of its own to the
private socket, bytes copied both ways. The relay accepts from the daemon's start on and
answers each connection's HTTP/2 handshake itself (transport/http2_drain.py says why); the
connections are joined to the gRPC server, and their calls forwarded, only once the state
is restored and the server serves (DESIGN §3). On stop, the calls forwarded are answered
and the later ones held back; the relay goes on accepting, answering handshakes and
holding calls, until the very end of the stop, and then tells each client (GOAWAY,
transport/http2_drain.py) to retry its held calls on a new connection. Those wait in the
kernel's backlog of the socket systemd keeps open only while this process exits and the
next one starts.

A relayed connection is closed once both its directions have ended (each side's EOF is
passed on to the other, and the second one closes both), or once a client ends its side
with no call open; a client gone before it sent a byte is never joined to the server.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from cri_shim.transport.http2_drain import (
    FRAME_SIZE_ERROR,
    GRPC_UNAVAILABLE,
    ClientToServer,
    FrameTooLarge,
    OpenStreams,
    ServerToClient,
    goaway_frame,
    reset_frame,
    settings_frame,
    status_frame,
)

log = logging.getLogger("cri_shim.transport.relay")

# How often a stopping daemon looks whether the last forwarded calls are answered.
ANSWERED_POLL = 0.005
# How long a stopping daemon lets a client finish sending a request it had begun; then
# the call is ended (RelayedConnection.end_unfinished). A CRI request is one message,
# sent whole at once by kubelet's client: one still unfinished by then is stalled.
UNFINISHED_GRACE = 1.0
UNFINISHED_MESSAGE = (
    "cri-shim is restarting and this call's request was not complete: "
    "the call was not served, retry it"
)


def _nothing(data: bytes) -> bytes:
    return b""


def _ignore() -> None:
    return None


def _never() -> bool:
    return False


def _same(end: _End) -> _End:
    return end


def _closed_unheard(transport: asyncio.Transport) -> bool:
    """Whether the peer of `transport`, not read yet, closed its side having sent
    nothing."""
    try:
        peek = socket.socket(fileno=transport.get_extra_info("socket").fileno())
    except OSError:
        return True  # no longer a socket
    try:
        return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    finally:
        peek.detach()


class _End(asyncio.Protocol):
    """One end of a relayed connection: what it receives is written, through `feed`, to
    the other end, in the callback that received it (no task in between: a call pays
    for the relay with two socket writes, not with trips through the event loop)."""

    def __init__(
        self,
        feed: Callable[[bytes], bytes],
        lost: Callable[[], None],
        made: Callable[[], None] | None = None,
        over: Callable[[], bool] = _never,
    ) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _End | None = None
        self.ended = False  # this end was told the other ended (EOF): nothing more to send
        self.received_eof = False  # its peer ended: nothing more comes from it
        self.passes_end = True  # its EOF and its close are passed on to the other end
        self._feed = feed
        self._lost = lost
        self._made = made
        self._over = over  # whether this end's EOF leaves nothing to wait for

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
        # still to come. Once both directions have ended, or nothing is left to answer,
        # this end closes, and closing it closes the other (connection_lost).
        self.received_eof = True
        other = self.other
        if not self.passes_end:
            return False  # this end closes; the other stays open
        if other is None or other.transport is None or other.transport.is_closing():
            return False
        if other.received_eof or self._over():
            return False
        if not other.ended and other.transport.can_write_eof():
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
        # What referred back to the connection goes: freed as soon as it is forgotten,
        # not at the collector's next full pass.
        self.other = None
        self._feed, self._lost, self._made, self._over = _nothing, _ignore, None, _never


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
        self.client = _End(
            self._from_client,
            lambda: forget(self),
            lambda: accepted(self),
            # A client that ends its side with no call open will ask nothing more.
            over=lambda: not self.streams.ids,
        )
        self.server = _End(self.outbound.feed, lambda: None)
        self.client.other, self.server.other = self.server, self.client
        self.preface_sent = False

    async def join(self, upstream: Path) -> None:
        """Connect to the gRPC server, then let the client's bytes flow (its end does
        not read until then)."""
        client = self.client.transport
        if client is None or client.is_closing() or _closed_unheard(client):
            # Gone before it said anything (a probe's connect and close): the gRPC
            # server is not connected to for it.
            self.close()
            return
        if self.outbound.holding:
            # Held since the daemon began to stop (a stop right after the start): its
            # calls are for the next daemon, to which the stop's GOAWAY sends them.
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.create_unix_connection(lambda: self.server, str(upstream))
        except OSError as exc:
            if self.outbound.holding:  # held while connecting; the server is gone already
                return
            log.warning("relay: cannot reach the gRPC server at %s: %s", upstream, exc)
            self.close()
            return
        if client.is_closing():  # gone while the connection was made
            self.close()
            return
        client.resume_reading()

    def _from_client(self, data: bytes) -> bytes:
        try:
            return self.inbound.feed(data)
        except FrameTooLarge as exc:
            # A connection error (RFC 9113 §4.2): the client is told why, and both ends
            # are closed; what it sent is not held.
            log.info("relay: a client sent %s; its connection is closed", exc)
            last = self.inbound.last_stream_id
            refusal = goaway_frame(
                last, b"frame larger than SETTINGS_MAX_FRAME_SIZE", FRAME_SIZE_ERROR
            )
            self.client.send(self.outbound.insert(refusal))
            self.close()
            return b""

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

    def end_unfinished(self) -> int:
        """End the calls whose request never ended (the client's END_STREAM): reset
        towards the server, and answered UNAVAILABLE to the client, saying why. Returns
        how many."""
        streams = self.streams
        unfinished = sorted(streams.unfinished)
        for stream in unfinished:
            streams.ended.add(stream)
            self.server.send(self.inbound.insert(reset_frame(stream)))
            begun = stream in streams.answer_begun
            status = status_frame(stream, GRPC_UNAVAILABLE, UNFINISHED_MESSAGE, begun)
            self.client.send(self.outbound.insert(status))
            streams.closed(stream)
        return len(unfinished)

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
        drain has been answered; False if some were not by then. The calls whose
        request has not ended UNFINISHED_GRACE after the drain are ended then."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        unfinished_ended = False
        while any(connection.streams.ids for connection in self._connections):
            waited = loop.time() - started
            if not unfinished_ended and waited >= UNFINISHED_GRACE:
                unfinished_ended = True
                ended = sum(connection.end_unfinished() for connection in self._connections)
                if ended:
                    log.warning(
                        "stopping: %d call(s) whose request was not complete after %.0fs "
                        "answered UNAVAILABLE",
                        ended,
                        UNFINISHED_GRACE,
                    )
                continue
            if waited > timeout:
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
