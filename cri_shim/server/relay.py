"""The relay from the socket systemd passed (server/activation.py) to the gRPC server's
private socket (server/unix_socket.py `bind_private_socket`).

grpcio cannot serve on a listening descriptor it did not bind, so the daemon relays:
each connection accepted on the activated socket is joined to one of its own to the
private socket, bytes copied both ways. Accepting starts only once the state is restored
(DESIGN §3): until then, and while the daemon restarts, connections wait in the kernel's
backlog of the socket systemd keeps open. On stop, each connection is drained
(server/http2_drain.py) so that its client retries new calls on the next daemon.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from pathlib import Path

from cri_shim.server.http2_drain import (
    ClientToServer,
    OpenStreams,
    ServerToClient,
    goaway_frame,
)

log = logging.getLogger("cri_shim.server.relay")

READ_SIZE = 256 * 1024
# How often a stopping daemon looks whether the last forwarded calls are answered.
ANSWERED_POLL = 0.005


class RelayedConnection:
    """One client's connection and the daemon's connection it is joined to."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.streams = OpenStreams()
        self.inbound = ClientToServer(self.streams)
        self.outbound = ServerToClient(self.streams)

    async def run(self, client: asyncio.StreamReader, upstream: asyncio.StreamReader) -> None:
        """Copy both ways until the daemon's side ends (it answers every stream it was
        sent, then closes); the client's end half-closes the daemon's side."""
        inbound = asyncio.create_task(self._copy(client, self.upstream, self.inbound.feed))
        try:
            await self._copy(upstream, self.client, self.outbound.feed)
        finally:
            inbound.cancel()
            await asyncio.gather(inbound, return_exceptions=True)
            for writer in (self.client, self.upstream):
                writer.close()

    def drain(self) -> None:
        """Tell the client that no stream after the last one forwarded will be served
        here (GOAWAY), and hold back the ones it opens anyway."""
        last = self.inbound.drain()
        frame = self.outbound.insert(goaway_frame(last, b"cri-shim is restarting"))
        if frame and not self.client.is_closing():
            self.client.write(frame)

    @staticmethod
    async def _copy(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        feed: Callable[[bytes], bytes],
    ) -> None:
        try:
            while data := await reader.read(READ_SIZE):
                if out := feed(data):
                    writer.write(out)
                    await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass


class SocketRelay:
    """Accepts on the activated socket once started; owns every relayed connection."""

    def __init__(self, listening: socket.socket, upstream: Path) -> None:
        self._listening = listening
        self._upstream = upstream
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], RelayedConnection | None] = {}
        self._draining = False

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(
            self._accepted, sock=self._listening, limit=READ_SIZE
        )

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = None
        try:
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(
                    str(self._upstream), limit=READ_SIZE
                )
            except OSError as exc:
                log.warning("relay: cannot reach the gRPC server at %s: %s", self._upstream, exc)
                writer.close()
                return
            connection = RelayedConnection(writer, up_writer)
            self._connections[task] = connection
            if self._draining:  # accepted just before the drain
                connection.drain()
            await connection.run(reader, up_reader)
        finally:
            del self._connections[task]

    def drain(self) -> None:
        """Stop accepting (connections wait in the backlog for the next daemon: systemd
        keeps the socket open) and drain every relayed connection."""
        self._draining = True
        if self._server is not None:
            # Closes this process's descriptor only; the socket stays systemd's.
            self._server.close()
        for connection in self._connections.values():
            if connection is not None:
                connection.drain()

    async def answered(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every stream forwarded before the
        drain has been answered; False if some were not by then."""
        deadline = asyncio.get_running_loop().time() + timeout
        while any(c is not None and c.streams.ids for c in self._connections.values()):
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(ANSWERED_POLL)
        return True

    async def aclose(self) -> None:
        """Once the gRPC server has stopped: end what is left."""
        self.drain()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._server = None
