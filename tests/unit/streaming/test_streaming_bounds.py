"""The streaming server's memory is bounded whatever a client sends: request heads have a
deadline and no body is read; SPDY sessions cap their streams and what they buffer;
WebSocket connections stop reading while what they received is not consumed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.uri import parse_uri

from cri_shim.streaming.chunks import ChunkQueue
from cri_shim.streaming.server import StreamingConfig, StreamingServer
from cri_shim.streaming.spdy import (
    MAX_BUFFERED_PER_SESSION,
    MAX_DATA_CHUNK,
    MAX_PEER_STREAMS,
    Data,
    FrameCodec,
    RstStatus,
    RstStream,
    SpdySession,
    SynReply,
    SynStream,
)
from cri_shim.streaming.websocket import MAX_BUFFERED, WebSocketConnection, make_protocol

# ---- HTTP request heads -------------------------------------------------------------------


async def _server(header_timeout: float = 30.0) -> StreamingServer:
    config = StreamingConfig(address="127.0.0.1:0", header_timeout=header_timeout)
    server = StreamingServer(config, backend=None)  # type: ignore[arg-type]
    await server.start()
    return server


async def _connect(server: StreamingServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.base_url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def test_a_request_body_is_refused_before_it_is_read() -> None:
    server = await _server()
    try:
        for framing in (b"Content-Length: 100000000", b"Transfer-Encoding: chunked"):
            reader, writer = await _connect(server)
            writer.write(b"POST /exec/token HTTP/1.1\r\nHost: node\r\n" + framing + b"\r\n\r\n")
            writer.write(b"x" * 65536)  # a body is coming, and would keep coming
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 413"), status
            writer.close()
    finally:
        await server.stop()


async def test_a_client_trickling_its_request_head_is_dropped() -> None:
    server = await _server(header_timeout=0.5)
    try:
        reader, writer = await _connect(server)
        writer.write(b"GET /exec/token HTTP/1.1\r\n")

        async def trickle() -> None:
            while True:  # one byte of a never-ending header, well inside any read timeout
                writer.write(b"X")
                await writer.drain()
                await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        try:
            # Closed by the server; the trickle itself would go on for ever. A close with
            # trickled bytes still unread is a reset rather than an end of stream.
            try:
                assert await asyncio.wait_for(reader.read(), 10) == b""
            except ConnectionResetError:
                pass
        finally:
            trickling.cancel()
        writer.close()
    finally:
        await server.stop()


# ---- SPDY sessions --------------------------------------------------------------------------


class _Inbox:
    """The server's transport: reads what the test queued, records what the server wrote."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue[bytes] = asyncio.Queue()
        self.codec = FrameCodec()
        self.sent: list[Any] = []

    async def read(self) -> bytes:
        return await self.incoming.get()

    async def write(self, data: bytes) -> None:
        self.codec.feed(data)
        self.sent.extend(self.codec.frames())

    async def close(self) -> None:
        self.incoming.put_nowait(b"")


async def _settle(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_a_session_refuses_streams_past_its_limit() -> None:
    transport = _Inbox()
    session = SpdySession(transport, server=True)
    running = asyncio.create_task(session.run())
    client = FrameCodec()
    try:
        ids = [1 + 2 * n for n in range(MAX_PEER_STREAMS + 1)]
        for stream_id in ids:
            transport.incoming.put_nowait(client.encode(SynStream(stream_id, {"streamtype": "x"})))
        await _settle(lambda: len(transport.sent) >= len(ids))
        replied = [f.stream_id for f in transport.sent if isinstance(f, SynReply)]
        refused = [f for f in transport.sent if isinstance(f, RstStream)]
        assert replied == ids[:-1]
        assert [(f.stream_id, f.status) for f in refused] == [(ids[-1], RstStatus.REFUSED_STREAM)]
    finally:
        await session.close()
        running.cancel()


async def test_a_session_stops_reading_past_what_it_may_buffer() -> None:
    transport = _Inbox()
    session = SpdySession(transport, server=True)
    running = asyncio.create_task(session.run())
    client = FrameCodec()
    try:
        # Four streams nobody reads, each under the per-stream limit, together over the
        # session's.
        streams = [1, 3, 5, 7]
        for stream_id in streams:
            transport.incoming.put_nowait(client.encode(SynStream(stream_id, {"streamtype": "x"})))
        per_stream = MAX_BUFFERED_PER_SESSION * 3 // 8
        chunk = b"z" * MAX_DATA_CHUNK
        for stream_id in streams:
            for _ in range(per_stream // MAX_DATA_CHUNK):
                transport.incoming.put_nowait(client.encode(Data(stream_id, chunk)))

        def buffered() -> int:
            return sum(s._buffered for s in session._streams.values())

        await _settle(lambda: buffered() > MAX_BUFFERED_PER_SESSION)
        await asyncio.sleep(0.2)
        assert buffered() <= MAX_BUFFERED_PER_SESSION + MAX_DATA_CHUNK
        assert transport.incoming.qsize() > 0  # the rest waits, unread
    finally:
        await session.close()
        running.cancel()


# ---- WebSocket ------------------------------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        pass


async def test_a_websocket_stops_reading_while_its_messages_are_not_consumed() -> None:
    client = ClientProtocol(parse_uri("ws://node/exec/token"))
    server = make_protocol(["v5.channel.k8s.io"])
    server.receive_data(_handshake(client))
    (request,) = server.events_received()
    server.send_response(server.accept(request))
    client.receive_data(b"".join(server.data_to_send()))
    client.events_received()

    reader = asyncio.StreamReader(limit=1 << 30)
    message = b"\x00" + b"s" * 65535  # stdin, which nobody reads
    total = 0
    while total < 8 * MAX_BUFFERED:
        client.send_frame(Frame(Opcode.BINARY, message))
        total += len(message)
    reader.feed_data(b"".join(client.data_to_send()))
    connection = WebSocketConnection(server, reader, _Writer())  # type: ignore[arg-type]
    running = asyncio.create_task(connection.run())
    try:
        await _settle(lambda: connection._messages.buffered >= MAX_BUFFERED)
        # Timed on purpose: that it reads no further is checked over a while.
        await asyncio.sleep(0.3)
        assert connection._messages.buffered <= MAX_BUFFERED + len(message)
        assert len(reader._buffer) > 0  # type: ignore[attr-defined]  # left unread
        # Consuming lets it read on.
        for _ in range(8):
            assert await asyncio.wait_for(connection.recv(), 10) == message
        await _settle(lambda: connection._messages.buffered >= MAX_BUFFERED)
    finally:
        running.cancel()


def _handshake(client: ClientProtocol) -> bytes:
    request = client.connect()
    client.send_request(request)
    return b"".join(client.data_to_send())


# ---- the queue itself -----------------------------------------------------------------------


async def test_a_chunk_queue_makes_its_producer_wait_and_ends_cleanly() -> None:
    queue = ChunkQueue(limit=10)
    await queue.put(b"12345")
    await queue.put(b"678901")  # over the limit now: the next put waits
    blocked = asyncio.create_task(queue.put(b"x"))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    assert await queue.get() == b"12345"
    await asyncio.wait_for(blocked, 1)
    queue.end()
    assert [await queue.get(), await queue.get(), await queue.get()] == [b"678901", b"x", None]
    assert await queue.get() is None
    await queue.put(b"late")  # dropped: nobody reads after the end
    assert await queue.get() is None
