"""The streaming server (exec, attach, port-forward), started by the first streaming RPC.

Its HTTP, SPDY and WebSocket machinery (h11, websockets) and the backend that reaches
containers (ptys, console sockets) are several MiB of an idle daemon's memory that a node
nobody execs into never needs: the backend too is made by the first streaming RPC. The
URL an RPC answers with names the server's address, so the server listens before the
first URL is handed out; from then on it serves until the daemon stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from cri_shim.streaming.backend import StreamingBackend

if TYPE_CHECKING:
    from pathlib import Path

    from cri_shim.streaming.server import StreamingServer


class StreamingOnDemand:
    def __init__(
        self,
        address: str,
        tls_cert: Path | None,
        tls_key: Path | None,
        make_backend: Callable[[], StreamingBackend],
    ) -> None:
        self._address = address
        self._tls = (tls_cert, tls_key)
        self._make_backend = make_backend
        self._server: StreamingServer | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    async def server(self) -> StreamingServer:
        """The listening server, started now if this is the first streaming request."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("the streaming server is stopped")
            if self._server is None:
                from cri_shim.streaming.server import StreamingConfig, StreamingServer

                cert, key = self._tls
                server = StreamingServer(
                    StreamingConfig(address=self._address, tls_cert=cert, tls_key=key),
                    self._make_backend(),
                )
                await server.start()
                self._server = server
            return self._server

    async def aclose(self) -> None:
        async with self._lock:
            self._closed = True
            if self._server is not None:
                await self._server.stop()
