"""Port-forward: copy bytes between client streams and TCP connections inside a pod.

Over SPDY (`portforward.k8s.io`, also when tunnelled in a WebSocket) the client opens a
pair of streams per connection, an error stream and a data stream, both carrying the
headers `port` and `requestID`; many pairs, for several ports, share one session. Over a
plain WebSocket (`v4.channel.k8s.io`) there is one connection per requested port, on
channels 2i (data) and 2i+1 (error), and the server starts each channel with the port
number as two little-endian bytes. A port that cannot be reached gets a message on its
error stream; the other ports are not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from dataclasses import dataclass

from cri_shim.errors import CriError
from cri_shim.streaming.backend import StreamingBackend
from cri_shim.streaming.spdy import RstStatus, SpdySession, SpdyStream
from cri_shim.streaming.tokens import PortForwardTarget
from cri_shim.streaming.websocket import ChannelMux, ChannelReader, ChannelWriter

log = logging.getLogger("cri_shim.streaming.portforward")

COPY_CHUNK = 32 * 1024


class PortRefused(Exception):
    """The port is not one the URL was issued for."""


def check_port(target: PortForwardTarget, port: int) -> None:
    if not 0 < port < 65536:
        raise PortRefused(f"invalid port {port}")
    # A URL issued for given ports may only reach those; one issued without ports (kubelet
    # passes none for SPDY clients, which name ports per stream) may reach any.
    if target.ports and port not in target.ports:
        raise PortRefused(f"port {port} was not requested for this port-forward")


def forward_error(target: PortForwardTarget, port: int, error: BaseException) -> bytes:
    return f"error forwarding port {port} to pod {target.sandbox_id}: {error}".encode()


async def _dial(
    backend: StreamingBackend, target: PortForwardTarget, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    check_port(target, port)
    return await backend.port_forward(target.sandbox_id, port)


async def _copy_from_target(
    reader: asyncio.StreamReader, write: SpdyStream | ChannelWriter
) -> None:
    while chunk := await reader.read(COPY_CHUNK):
        await write.write(chunk)


async def _copy_to_target(read: SpdyStream | ChannelReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await read.read():
        writer.write(chunk)
        await writer.drain()
    # The client is done sending: pass the half-close on, the server may still answer.
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 2.0)


# -- SPDY ----------------------------------------------------------------------------------


@dataclass
class _Pair:
    request_id: str
    port: int
    data: SpdyStream | None = None
    error: SpdyStream | None = None
    started: bool = False


async def serve_spdy_portforward(
    session: SpdySession,
    backend: StreamingBackend,
    target: PortForwardTarget,
    *,
    stream_creation_timeout: float,
) -> None:
    """Pair the client's streams by request ID and forward each pair until the session ends."""
    pairs: dict[str, _Pair] = {}
    expiries: list[asyncio.Task[None]] = []
    async with asyncio.TaskGroup() as tasks:
        while (stream := await session.accept_stream()) is not None:
            pair = await _add_to_pair(stream, pairs)
            if pair is None:
                continue
            if pair.data is not None and pair.error is not None and not pair.started:
                pair.started = True
                tasks.create_task(_forward_pair(backend, target, pair, pairs))
            elif not pair.started:
                expiries.append(
                    tasks.create_task(_expire_pair(pair, pairs, stream_creation_timeout))
                )
        # The session is over: every pair's streams are reset, which ends the forwarders;
        # the timers of half-made pairs have nothing left to do.
        for expiry in expiries:
            expiry.cancel()


async def _add_to_pair(stream: SpdyStream, pairs: dict[str, _Pair]) -> _Pair | None:
    headers = stream.headers
    kind = headers.get("streamtype", "")
    try:
        port = int(headers.get("port", ""))
    except ValueError:
        log.info("port-forward stream %s without a valid port header", stream.stream_id)
        await stream.reset(RstStatus.PROTOCOL_ERROR)
        return None
    request_id = headers.get("requestid")
    if request_id is None:
        # Clients from before request IDs open the error stream, then the data stream,
        # with consecutive IDs; pair them the same way.
        request_id = str(stream.stream_id if kind == "error" else stream.stream_id - 2)
    pair = pairs.setdefault(request_id, _Pair(request_id, port))
    if kind == "data" and pair.data is None:
        pair.data = stream
    elif kind == "error" and pair.error is None:
        pair.error = stream
    else:
        log.info("unexpected port-forward stream %r for request %s", kind, request_id)
        await stream.reset(RstStatus.PROTOCOL_ERROR)
        return None
    return pair


async def _expire_pair(pair: _Pair, pairs: dict[str, _Pair], delay: float) -> None:
    await asyncio.sleep(delay)
    if not pair.started and pairs.get(pair.request_id) is pair:
        log.info("port-forward request %s never got both streams; dropping it", pair.request_id)
        del pairs[pair.request_id]
        for stream in (pair.data, pair.error):
            if stream is not None:
                await stream.reset()


async def _forward_pair(
    backend: StreamingBackend, target: PortForwardTarget, pair: _Pair, pairs: dict[str, _Pair]
) -> None:
    assert pair.data is not None and pair.error is not None
    data, error = pair.data, pair.error
    try:
        try:
            reader, writer = await _dial(backend, target, pair.port)
        except (CriError, OSError, PortRefused) as exc:
            with contextlib.suppress(ConnectionError):
                await error.write(forward_error(target, pair.port, exc))
                await error.close()
                await data.close()
            return
        upstream = asyncio.create_task(_copy_to_target(data, writer))
        downstream = asyncio.create_task(_copy_from_target(reader, data))
        reset = asyncio.create_task(data.reset_seen.wait())
        try:
            await asyncio.wait([downstream, reset], return_when=asyncio.FIRST_COMPLETED)
            if downstream.done():
                # The pod's side ended: finish both streams, which is what tells kubectl
                # this connection is over (it waits for the error stream to end), then let
                # the client finish sending or reset the pair.
                with contextlib.suppress(ConnectionError):
                    await data.close()
                    await error.close()
                await asyncio.wait([upstream, reset], return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel_quietly(upstream, downstream, reset)
            await _close_writer(writer)
    finally:
        pairs.pop(pair.request_id, None)


async def _cancel_quietly(*tasks: asyncio.Task[object]) -> None:
    for task in tasks:
        task.cancel()
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, Exception) and not isinstance(result, ConnectionError | OSError):
            log.warning("port-forward copy failed: %r", result)


# -- WebSocket (v4.channel.k8s.io) ---------------------------------------------------------


async def serve_websocket_portforward(
    mux: ChannelMux,
    backend: StreamingBackend,
    target: PortForwardTarget,
    ports: list[int],
    *,
    client_gone: asyncio.Event,
) -> None:
    """One connection per port, each on its own data/error channel pair."""
    async with asyncio.TaskGroup() as tasks:
        for index, port in enumerate(ports):
            data_in = mux.reader(2 * index)
            data_out, error_out = mux.writer(2 * index), mux.writer(2 * index + 1)
            prefix = struct.pack("<H", port)
            await mux.send(2 * index, prefix)
            await mux.send(2 * index + 1, prefix)
            tasks.create_task(
                _forward_channel(backend, target, port, data_in, data_out, error_out, client_gone)
            )


async def _forward_channel(
    backend: StreamingBackend,
    target: PortForwardTarget,
    port: int,
    data_in: ChannelReader,
    data_out: ChannelWriter,
    error_out: ChannelWriter,
    client_gone: asyncio.Event,
) -> None:
    try:
        reader, writer = await _dial(backend, target, port)
    except (CriError, OSError, PortRefused) as exc:
        with contextlib.suppress(ConnectionError):
            await error_out.write(forward_error(target, port, exc))
        return
    upstream = asyncio.create_task(_copy_to_target(data_in, writer))
    downstream = asyncio.create_task(_copy_from_target(reader, data_out))
    gone = asyncio.create_task(client_gone.wait())
    try:
        # v4 has no way to say one channel ended; the connection lasts until the pod's
        # side closes or the client hangs up.
        await asyncio.wait([downstream, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        await _cancel_quietly(upstream, downstream, gone)
        await _close_writer(writer)
