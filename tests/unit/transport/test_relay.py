"""The relay from the activated socket to the gRPC server's private socket, with a fake
upstream standing for gRPC's server: it records what reaches it and answers on cue."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cri_shim.transport.activation import EarlyAcceptor
from cri_shim.transport.http2_drain import (
    ACK,
    DATA,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PREFACE,
    SETTINGS,
    frame,
    goaway_frame,
    settings_frame,
)
from cri_shim.transport.relay import SocketRelay
from tests.waiting import until


class FakeUpstream:
    """Stands for the gRPC server behind the private socket."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.arrived = asyncio.Condition()
        self.writers: list[asyncio.StreamWriter] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        async with self.arrived:
            self.arrived.notify_all()
        while data := await reader.read(65536):
            async with self.arrived:
                self.received += data
                self.arrived.notify_all()
        writer.close()

    async def until(self, predicate) -> None:  # type: ignore[no-untyped-def]
        async with self.arrived:
            await self.arrived.wait_for(predicate)


@dataclass
class Rig:
    held: socket.socket  # the CRI socket, systemd's copy
    upstream: FakeUpstream
    relay: SocketRelay  # given the daemon's copy
    directory: Path

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(self.directory / "cri.sock"))

    async def serve(self, relay: SocketRelay) -> None:
        """Start `relay` with the fake gRPC server serving, as a restored daemon does."""
        await relay.start()
        relay.serve(self.directory / "private")

    def next_relay(self) -> SocketRelay:
        return SocketRelay(self.held.dup())


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held.bind(str(tmp_path / "cri.sock"))
    held.listen()
    upstream = FakeUpstream()
    server = await asyncio.start_unix_server(upstream.serve, path=str(tmp_path / "private"))
    made = Rig(held, upstream, SocketRelay(held.dup()), tmp_path)
    yield made
    await made.relay.aclose()
    server.close()
    held.close()


async def test_connections_wait_in_the_backlog_until_the_relay_starts(rig: Rig) -> None:
    upstream, relay = rig.upstream, rig.relay
    # Made while the daemon restarts: the kernel completes it, nobody accepts.
    reader, client = await rig.connect()
    client.write(PREFACE)
    await client.drain()
    assert upstream.writers == [] and upstream.received == b""
    await rig.serve(relay)
    assert await reader.readexactly(9) == settings_frame()
    await upstream.until(lambda: bytes(upstream.received) == PREFACE)
    client.close()


async def test_the_handshake_is_answered_at_once_and_calls_wait_for_the_server(rig: Rig) -> None:
    """While the daemon restores its state the relay accepts and answers the server's
    half of the preface (a gRPC client closes a connection left unanswered 20 s, and
    fails its calls); the calls reach the server once it serves, without the client's
    acknowledgement of the relay's SETTINGS (the server's own are acknowledged later)."""
    upstream, relay = rig.upstream, rig.relay
    await relay.start()
    reader, client = await rig.connect()
    assert await reader.readexactly(9) == settings_frame()  # before anything is served
    ack = frame(SETTINGS, 0, flags=ACK)
    call = frame(HEADERS, 1, b"call one", flags=0x4)
    client.write(PREFACE + frame(SETTINGS, 0, b"\0\x03\0\0\0\x64") + ack + call)
    await client.drain()
    assert upstream.writers == []
    relay.serve(rig.directory / "private")
    expected = PREFACE + frame(SETTINGS, 0, b"\0\x03\0\0\0\x64") + call
    await upstream.until(lambda: bytes(upstream.received) == expected)
    # The server's SETTINGS, and the client's acknowledgement of them, pass.
    upstream.writers[0].write(frame(SETTINGS, 0, b"\0\x04\0\x01\0\0"))
    assert await reader.readexactly(15) == frame(SETTINGS, 0, b"\0\x04\0\x01\0\0")
    client.write(ack)
    await upstream.until(lambda: bytes(upstream.received) == expected + ack)
    client.close()


async def test_the_drain_holds_back_later_streams_and_says_goaway_at_the_end(rig: Rig) -> None:
    upstream, relay = rig.upstream, rig.relay
    await rig.serve(relay)
    reader, client = await rig.connect()
    assert await reader.readexactly(9) == settings_frame()
    first = PREFACE + frame(HEADERS, 1, b"call one", flags=0x4)
    client.write(first)
    await upstream.until(lambda: bytes(upstream.received) == first)

    relay.drain()
    # A stream opened after the drain never reaches the server; stream 1's body does.
    body = frame(DATA, 1, b"body of one", flags=END_STREAM)
    client.write(frame(HEADERS, 3, b"call two", flags=0x4) + body)
    await upstream.until(lambda: bytes(upstream.received).endswith(body))
    assert bytes(upstream.received) == first + body

    # The daemon stops its server only once stream 1 is answered.
    answered = asyncio.create_task(relay.answered(timeout=300))
    await asyncio.sleep(0)
    assert not answered.done()
    answer = frame(HEADERS, 1, b"trailers", flags=0x4 | END_STREAM)
    upstream.writers[0].write(answer)
    assert await answered
    assert await reader.readexactly(len(answer)) == answer

    # The server stops: neither its GOAWAY nor its close reach the client, which would
    # retry stream 3 at once, on a connection this relay would take.
    upstream.writers[0].write(goaway_frame(0x7FFFFFFF))
    upstream.writers[0].close()
    (connection,) = relay.connections
    await until(lambda: connection.server.transport and connection.server.transport.is_closing())
    # At the end of the stop the relay says it, once: stream 1 was served, 3 was not.
    await relay.aclose()
    goaway = await reader.readexactly(17 + len(b"cri-shim is restarting"))
    assert goaway[3] == GOAWAY
    assert struct.unpack(">I", goaway[9:13]) == (1,)
    client.close()


async def test_connections_accepted_early_are_taken_over_as_answered(rig: Rig) -> None:
    """While the daemon's modules load, the early acceptor answers the preface of the
    connections waiting since the last daemon stopped; the relay takes them over without
    answering again and forwards their calls once the server serves."""
    listening = rig.held.dup()
    acceptor = EarlyAcceptor(listening)
    reader, client = await rig.connect()
    assert await reader.readexactly(9) == settings_frame()
    ack = frame(SETTINGS, 0, flags=ACK)
    call = frame(HEADERS, 1, b"call one", flags=0x4)
    client.write(PREFACE + ack + call)
    await client.drain()
    early = acceptor.take()
    assert len(early) == 1
    relay = SocketRelay(listening)
    await relay.start(early)
    relay.serve(rig.directory / "private")
    await rig.upstream.until(lambda: bytes(rig.upstream.received) == PREFACE + call)
    answer = frame(HEADERS, 1, b"trailers", flags=0x4 | END_STREAM)
    rig.upstream.writers[0].write(answer)
    assert await reader.readexactly(len(answer)) == answer  # no second SETTINGS before
    await relay.aclose()
    client.close()


async def test_connections_made_during_the_drain_are_held_until_the_end(rig: Rig) -> None:
    """A client told to go makes a new connection while the daemon stops: the stopping
    relay answers its handshake and holds its calls until the end of the stop, then tells
    it to go too; the connection it makes then waits in the backlog for the next relay."""
    upstream, relay = rig.upstream, rig.relay
    await rig.serve(relay)
    _, early = await rig.connect()
    await upstream.until(lambda: len(upstream.writers) == 1)
    relay.drain()
    reader, late = await rig.connect()
    assert await reader.readexactly(9) == settings_frame()
    late.write(PREFACE + frame(HEADERS, 1, b"call one", flags=0x4))
    await late.drain()
    await relay.aclose()
    # None of its calls was served here: the GOAWAY names stream 0, and it is closed.
    goaway = await reader.readexactly(17 + len(b"cri-shim is restarting"))
    assert goaway[3] == GOAWAY
    assert struct.unpack(">I", goaway[9:13]) == (0,)
    # Closed (reset: what the client sent is left unread).
    with contextlib.suppress(ConnectionResetError):
        assert await reader.read() == b""
    assert len(upstream.writers) == 1 and upstream.received == b""
    # The socket is still listening (systemd's copy): the next connection is queued, and
    # the next daemon's relay takes it.
    _, last = await rig.connect()
    last.write(PREFACE)
    await last.drain()
    next_relay = rig.next_relay()
    await rig.serve(next_relay)
    await upstream.until(lambda: len(upstream.writers) == 2 and upstream.received == PREFACE)
    await next_relay.aclose()
    for client in (early, late, last):
        client.close()


async def test_a_connection_the_server_has_ended_is_drained_without_a_write(rig: Rig) -> None:
    """The server closed its side (a client's channel closing); the client has its EOF
    and the connection is not yet gone when the daemon stops: nothing is written after
    the EOF (asyncio raises for it, which once failed the daemon's stop)."""
    upstream, relay = rig.upstream, rig.relay
    await rig.serve(relay)
    reader, client = await rig.connect()
    client.write(PREFACE)
    await upstream.until(lambda: bytes(upstream.received) == PREFACE)
    upstream.writers[0].write_eof()
    assert await reader.read() == settings_frame()  # the relay's, then the server's EOF
    relay.drain()
    client.close()


async def test_a_connection_is_closed_once_both_directions_have_ended(rig: Rig) -> None:
    """The client ends its side after its call, the server answers and ends its own:
    nothing is left of the connection in the relay."""
    upstream, relay = rig.upstream, rig.relay
    await rig.serve(relay)
    reader, client = await rig.connect()
    call = PREFACE + frame(HEADERS, 1, b"call", flags=0x4 | END_STREAM)
    client.write(call)
    client.write_eof()
    await upstream.until(lambda: bytes(upstream.received) == call)
    answer = frame(HEADERS, 1, b"trailers", flags=0x4 | END_STREAM)
    upstream.writers[0].write(answer)
    assert await reader.read() == settings_frame() + answer  # to the end: closed
    await until(lambda: not relay.connections)
    client.close()


async def test_a_client_gone_before_a_word_is_not_joined_to_the_server(rig: Rig) -> None:
    """Probes that connect and end their side having said nothing, while the daemon
    restores: no connection to the gRPC server is made for them once it serves, and
    theirs are closed."""
    upstream, relay = rig.upstream, rig.relay
    await relay.start()
    probes = []
    for _ in range(3):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(rig.directory / "cri.sock"))
        probe.shutdown(socket.SHUT_WR)
        probes.append(probe)
    await until(lambda: len(relay.connections) == 3)
    relay.serve(rig.directory / "private")
    await until(lambda: not relay.connections)
    assert upstream.writers == []
    for probe in probes:
        probe.setblocking(True)
        assert probe.recv(100) == settings_frame() and probe.recv(100) == b""
        probe.close()
