"""Fixtures of the streaming tests: a server on loopback with the process test backend, and
TCP echo servers to forward to. Everything started here is stopped at teardown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from cri_shim.streaming.server import StreamingConfig, StreamingServer
from tests.integration.streaming.process_backend import ProcessTestBackend


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def backend() -> AsyncIterator[ProcessTestBackend]:
    made = ProcessTestBackend()
    yield made
    await made.close()


@pytest.fixture
async def server(backend: ProcessTestBackend, clock: FakeClock) -> AsyncIterator[StreamingServer]:
    made = StreamingServer(StreamingConfig(stream_creation_timeout=5.0), backend, clock=clock)
    await made.start()
    yield made
    await made.stop()


@dataclass
class EchoServer:
    """Answers each connection with `<tag>:` followed by whatever it receives."""

    tag: bytes
    server: asyncio.Server | None = None
    connections: int = 0
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            writer.write(self.tag + b":")
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


@pytest.fixture
async def echo_servers() -> AsyncIterator[Callable[[bytes], asyncio.Future[EchoServer]]]:
    made: list[EchoServer] = []

    async def start(tag: bytes) -> EchoServer:
        echo = EchoServer(tag)
        echo.server = await asyncio.start_server(echo._handle, "127.0.0.1", 0)
        made.append(echo)
        return echo

    yield start  # type: ignore[misc]
    for echo in made:
        assert echo.server is not None
        echo.server.close()
        for task in list(echo.handlers):
            task.cancel()
        await echo.server.wait_closed()


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
