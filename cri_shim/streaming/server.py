"""The CRI streaming server: the URLs that Exec, Attach and PortForward return, and their serving.

The RPC handlers call `get_exec_url` (and friends), which validate the request, keep it
under a single-use token and return `http://<host>:<port>/exec/<token>`. The client
(kubelet on behalf of kubectl, or crictl) then connects to that URL and upgrades the
connection to SPDY/3.1 or to a WebSocket. One asyncio listener serves both: HTTP/1.1
requests are parsed with h11, and after the 101 response the connection belongs to the
SPDY session or to websockets' protocol object.

Protocols:
- SPDY/3.1 with `X-Stream-Protocol-Version` `v4.channel.k8s.io` (JSON status on the error
  stream), `v3.channel.k8s.io` (adds resize), `v2.channel.k8s.io`, `channel.k8s.io`;
  `portforward.k8s.io` for port-forward.
- WebSocket with `v5.channel.k8s.io`, `v4.channel.k8s.io` or `channel.k8s.io` for exec
  and attach; `v4.channel.k8s.io` and `SPDY/3.1+portforward.k8s.io` (SPDY tunnelled in
  binary messages, what kubectl 1.30+ sends) for port-forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import h11
from websockets.http11 import Request as WsRequest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.streaming.backend import StreamingBackend
from cri_shim.streaming.portforward import (
    serve_spdy_portforward,
    serve_websocket_portforward,
)
from cri_shim.streaming.remotecommand import CommandStreams, serve_attach, serve_exec
from cri_shim.streaming.spdy import SpdySession, SpdyStream
from cri_shim.streaming.tokens import (
    DEFAULT_TOKEN_TTL,
    AttachTarget,
    ExecTarget,
    PortForwardTarget,
    StreamTarget,
    TokenCache,
)
from cri_shim.streaming.websocket import (
    ChannelMux,
    WebSocketConnection,
    WebSocketTransport,
    make_protocol,
)

log = logging.getLogger("cri_shim.streaming")

# Remote command protocols, in the order we prefer them.
REMOTECOMMAND_V4 = "v4.channel.k8s.io"
REMOTECOMMAND_V3 = "v3.channel.k8s.io"
REMOTECOMMAND_V2 = "v2.channel.k8s.io"
REMOTECOMMAND_V1 = "channel.k8s.io"
REMOTECOMMAND_V5 = "v5.channel.k8s.io"  # WebSocket only
SPDY_REMOTECOMMAND_PROTOCOLS = (
    REMOTECOMMAND_V4,
    REMOTECOMMAND_V3,
    REMOTECOMMAND_V2,
    REMOTECOMMAND_V1,
)
WS_REMOTECOMMAND_PROTOCOLS = (REMOTECOMMAND_V5, REMOTECOMMAND_V4, REMOTECOMMAND_V1)
PORTFORWARD_V1 = "portforward.k8s.io"
WS_PORTFORWARD_TUNNEL = "SPDY/3.1+portforward.k8s.io"
WS_PORTFORWARD_PROTOCOLS = (WS_PORTFORWARD_TUNNEL, REMOTECOMMAND_V4, REMOTECOMMAND_V1)

HEADER_TIMEOUT = 30.0
MAX_REQUEST_HEAD = 64 * 1024
LINGER = 2.0


@dataclass(frozen=True)
class StreamingConfig:
    """`[streaming]` in the daemon's configuration."""

    address: str = "127.0.0.1:0"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token_ttl: float = DEFAULT_TOKEN_TTL
    # How long a client may take to open all the streams of one exec/attach/port pair.
    stream_creation_timeout: float = 30.0
    # How long a client may take to send its whole request head (a trickle of bytes
    # cannot hold a connection for longer).
    header_timeout: float = HEADER_TIMEOUT


def parse_address(address: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces) to (host, port)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidArgument(f"streaming address {address!r}: expected host:port")
    host = host.strip("[]")
    if host:
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(host)
    return host, int(port_text)


class StreamingServer:
    """Owned by the daemon: `await start()` with it, `await stop()` at shutdown."""

    def __init__(
        self,
        config: StreamingConfig,
        backend: StreamingBackend,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._backend = backend
        self._tokens = TokenCache(config.token_ttl, clock=clock)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._base_url = ""

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        host, port = parse_address(self._config.address)
        tls = self._tls_context()
        self._server = await asyncio.start_server(
            self._on_connection, host or None, port, ssl=tls, limit=MAX_REQUEST_HEAD
        )
        bound = self._server.sockets[0].getsockname()
        url_host = host or "127.0.0.1"
        if url_host in ("0.0.0.0", "::"):
            # A wildcard is not an address a client can dial; loopback works on the node.
            url_host = "127.0.0.1" if url_host == "0.0.0.0" else "::1"
        if ":" in url_host:
            url_host = f"[{url_host}]"
        scheme = "https" if tls is not None else "http"
        self._base_url = f"{scheme}://{url_host}:{bound[1]}"
        log.info("streaming server listening on %s", self._base_url)

    async def stop(self) -> None:
        """Stop listening and end every open stream (commands still running are killed)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), LINGER)
            self._server = None

    @property
    def base_url(self) -> str:
        if not self._base_url:
            raise RuntimeError("the streaming server is not started")
        return self._base_url

    def _tls_context(self) -> ssl.SSLContext | None:
        cert, key = self._config.tls_cert, self._config.tls_key
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise InvalidArgument("streaming: tls_cert and tls_key must be given together")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        return context

    # -- URLs for the RPC handlers ------------------------------------------------------

    def get_exec_url(self, req: api_pb2.ExecRequest) -> str:
        if not req.container_id:
            raise InvalidArgument("exec: container_id is required")
        if not req.cmd:
            raise InvalidArgument("exec: cmd is required")
        _check_stdio(req.stdin, req.stdout, req.stderr, req.tty, "exec")
        target = ExecTarget(
            req.container_id, tuple(req.cmd), req.tty, req.stdin, req.stdout, req.stderr
        )
        return f"{self.base_url}/exec/{self._tokens.insert(target)}"

    def get_attach_url(self, req: api_pb2.AttachRequest) -> str:
        if not req.container_id:
            raise InvalidArgument("attach: container_id is required")
        _check_stdio(req.stdin, req.stdout, req.stderr, req.tty, "attach")
        target = AttachTarget(req.container_id, req.tty, req.stdin, req.stdout, req.stderr)
        return f"{self.base_url}/attach/{self._tokens.insert(target)}"

    def get_portforward_url(self, req: api_pb2.PortForwardRequest) -> str:
        if not req.pod_sandbox_id:
            raise InvalidArgument("port-forward: pod_sandbox_id is required")
        for port in req.port:
            if not 0 < port < 65536:
                raise InvalidArgument(f"port-forward: invalid port {port}")
        target = PortForwardTarget(req.pod_sandbox_id, tuple(req.port))
        return f"{self.base_url}/portforward/{self._tokens.insert(target)}"

    # -- connections --------------------------------------------------------------------

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            # Only stop() cancels these tasks. Ending normally keeps asyncio's stream
            # callback (which asks the task for its exception) from logging an error.
            pass
        except (ConnectionError, OSError, TimeoutError) as exc:
            log.debug("streaming connection ended: %r", exc)
        except Exception:
            log.exception("streaming connection failed")
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), LINGER)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD)
        request: h11.Request | None = None
        received = bytearray()  # the raw request, for websockets' own parser
        try:
            async with asyncio.timeout(self._config.header_timeout):
                while True:
                    event = http.next_event()
                    if event is h11.NEED_DATA:
                        data = await reader.read(65536)
                        received += data
                        http.receive_data(data)
                    elif isinstance(event, h11.Request):
                        request = event
                        if _has_body(request):
                            # Every path here is an upgrade with no body: none is read.
                            await _respond(writer, http, 413, "a request body is not accepted")
                            return
                    elif isinstance(event, h11.EndOfMessage) or event is h11.PAUSED:
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        return
        except h11.RemoteProtocolError as exc:
            await _respond(writer, http, 400, f"bad request: {exc}")
            return
        assert request is not None
        pending, _ = http.trailing_data
        head = _RequestHead.from_h11(request, bytes(received[: len(received) - len(pending)]))

        kind, _, token = head.path.strip("/").partition("/")
        target = self._tokens.consume(token) if token and "/" not in token else None
        expected = {"exec": ExecTarget, "attach": AttachTarget, "portforward": PortForwardTarget}
        if kind not in expected or target is None or not isinstance(target, expected[kind]):
            await _respond(writer, http, 404, "404 page not found: unknown or expired token")
            return
        upgrade = head.header("upgrade").lower()
        if "websocket" in upgrade:
            await self._serve_websocket(head, target, reader, writer, pending)
        elif "spdy/3.1" in upgrade:
            await self._serve_spdy(head, target, reader, writer, http, pending)
        else:
            await _respond(
                writer, http, 400, "Upgrade request required: use SPDY/3.1 or a WebSocket"
            )

    # -- SPDY ---------------------------------------------------------------------------

    async def _serve_spdy(
        self,
        head: _RequestHead,
        target: StreamTarget,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        http: h11.Connection,
        pending: bytes,
    ) -> None:
        supported = (
            (PORTFORWARD_V1,)
            if isinstance(target, PortForwardTarget)
            else SPDY_REMOTECOMMAND_PROTOCOLS
        )
        offered = [
            item.strip()
            for value in head.headers_named("x-stream-protocol-version")
            for item in value.split(",")
            if item.strip()
        ]
        protocol = next((name for name in offered if name in supported), None)
        if offered and protocol is None:
            await _respond(
                writer,
                http,
                403,
                f"unable to upgrade: unable to negotiate protocol: client supports "
                f"{offered}, server accepts {list(supported)}",
                extra=[("X-Accepted-Stream-Protocol-Versions", name) for name in supported],
            )
            return
        protocol = protocol or (PORTFORWARD_V1 if isinstance(target, PortForwardTarget) else "")
        response = (
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
        )
        if protocol:
            response += f"X-Stream-Protocol-Version: {protocol}\r\n"
        writer.write((response + "\r\n").encode())
        await writer.drain()

        transport = _SocketTransport(reader, writer, pending)
        session = SpdySession(transport, server=True)
        await self._run_spdy(session, target, protocol)

    async def _run_spdy(self, session: SpdySession, target: StreamTarget, protocol: str) -> None:
        """Serve one SPDY session (over a socket or tunnelled in a WebSocket), then close it."""
        reading = asyncio.create_task(session.run())
        try:
            if isinstance(target, PortForwardTarget):
                await serve_spdy_portforward(
                    session,
                    self._backend,
                    target,
                    stream_creation_timeout=self._config.stream_creation_timeout,
                )
            else:
                streams = await self._collect_spdy_streams(session, target, protocol)
                if streams is None:
                    return
                json_status = protocol == REMOTECOMMAND_V4
                if isinstance(target, ExecTarget):
                    await serve_exec(
                        self._backend,
                        target,
                        streams,
                        json_status=json_status,
                        client_gone=session.closed,
                    )
                else:
                    await serve_attach(
                        self._backend,
                        target,
                        streams,
                        json_status=json_status,
                        client_gone=session.closed,
                    )
        finally:
            await session.close()
            # Give the client a moment to read what we sent and close its side; closing at
            # once with its bytes unread would make the kernel reset the connection.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(reading), LINGER)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    async def _collect_spdy_streams(
        self, session: SpdySession, target: ExecTarget | AttachTarget, protocol: str
    ) -> CommandStreams | None:
        """Wait until the client has opened every stream the request asked for."""
        expected = {"error"}
        if target.stdin:
            expected.add("stdin")
        if target.stdout:
            expected.add("stdout")
        if target.stderr:
            expected.add("stderr")
        if target.tty and protocol in (REMOTECOMMAND_V3, REMOTECOMMAND_V4):
            expected.add("resize")
        found: dict[str, SpdyStream] = {}

        async def collect() -> bool:
            while not expected <= found.keys():
                stream = await session.accept_stream()
                if stream is None:
                    return False
                kind = stream.headers.get("streamtype", "")
                if kind in ("error", "stdin", "stdout", "stderr", "resize"):
                    found.setdefault(kind, stream)
                else:
                    await stream.reset()
            return True

        try:
            complete = await asyncio.wait_for(collect(), self._config.stream_creation_timeout)
        except TimeoutError:
            log.info("client opened only %s of the streams %s", sorted(found), sorted(expected))
            return None
        if not complete:
            return None
        return CommandStreams(
            error=found.get("error"),
            stdin=found.get("stdin") if target.stdin else None,
            stdout=found.get("stdout"),
            stderr=found.get("stderr"),
            resize=found.get("resize") if target.tty else None,
        )

    # -- WebSocket ----------------------------------------------------------------------

    async def _serve_websocket(
        self,
        head: _RequestHead,
        target: StreamTarget,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pending: bytes,
    ) -> None:
        supported = (
            WS_PORTFORWARD_PROTOCOLS
            if isinstance(target, PortForwardTarget)
            else WS_REMOTECOMMAND_PROTOCOLS
        )
        protocol = make_protocol([_ws_token(name) for name in supported])
        # websockets parses the handshake itself (its parser must see the request before
        # the first frames); h11 has only been used to route it here. "SPDY/3.1+..." is
        # not an RFC 6455 token (the "/"), which websockets rejects, so it goes in under an
        # alias and comes back out under its real name in the response.
        protocol.receive_data(
            head.raw.replace(_TUNNEL_BYTES, _ws_token(WS_PORTFORWARD_TUNNEL).encode())
        )
        request = next((e for e in protocol.events_received() if isinstance(e, WsRequest)), None)
        if request is None:
            for chunk in protocol.data_to_send():
                writer.write(chunk)
            return
        response = protocol.accept(request)
        if protocol.subprotocol == _ws_token(WS_PORTFORWARD_TUNNEL):
            del response.headers["Sec-WebSocket-Protocol"]
            response.headers["Sec-WebSocket-Protocol"] = WS_PORTFORWARD_TUNNEL
        protocol.send_response(response)
        for chunk in protocol.data_to_send():
            writer.write(chunk)
        await writer.drain()
        if response.status_code != 101:
            return
        connection = WebSocketConnection(protocol, reader, writer)
        reading = asyncio.create_task(connection.run(pending))
        try:
            await self._run_websocket(connection, head, target)
        finally:
            await connection.close()
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading

    async def _run_websocket(
        self, connection: WebSocketConnection, head: _RequestHead, target: StreamTarget
    ) -> None:
        subprotocol = connection.subprotocol or REMOTECOMMAND_V1
        if subprotocol == _ws_token(WS_PORTFORWARD_TUNNEL):
            assert isinstance(target, PortForwardTarget)
            session = SpdySession(WebSocketTransport(connection), server=True)
            await self._run_spdy(session, target, PORTFORWARD_V1)
            return
        mux = ChannelMux(connection, close_frames=subprotocol == REMOTECOMMAND_V5)
        if isinstance(target, PortForwardTarget):
            ports = list(target.ports) or _ports_from_query(head.query)
            routing = asyncio.create_task(mux.run())
            try:
                await serve_websocket_portforward(
                    mux, self._backend, target, ports, client_gone=connection.closed
                )
            finally:
                routing.cancel()
            return
        streams = CommandStreams(
            error=mux.writer(3),
            stdin=mux.reader(0) if target.stdin else None,
            stdout=mux.writer(1) if target.stdout else None,
            stderr=mux.writer(2) if target.stderr else None,
            resize=mux.reader(4) if target.tty else None,
        )
        routing = asyncio.create_task(mux.run())
        try:
            json_status = subprotocol in (REMOTECOMMAND_V5, REMOTECOMMAND_V4)
            serve = serve_exec if isinstance(target, ExecTarget) else serve_attach
            await serve(
                self._backend,
                target,  # type: ignore[arg-type]
                streams,
                json_status=json_status,
                client_gone=connection.closed,
            )
        finally:
            routing.cancel()


_TUNNEL_BYTES = WS_PORTFORWARD_TUNNEL.encode()


def _has_body(request: h11.Request) -> bool:
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


def _ws_token(name: str) -> str:
    return name.replace("/", "-")


def _check_stdio(stdin: bool, stdout: bool, stderr: bool, tty: bool, what: str) -> None:
    if not (stdin or stdout or stderr):
        raise InvalidArgument(f"{what}: one of stdin, stdout, or stderr must be set")
    if tty and stderr:
        raise InvalidArgument(
            f"{what}: tty and stderr cannot both be set (a terminal merges stderr into stdout)"
        )


def _ports_from_query(query: dict[str, list[str]]) -> list[int]:
    ports = []
    for value in query.get("ports", []) + query.get("port", []):
        for item in value.split(","):
            if item.strip().isdigit():
                ports.append(int(item))
    return ports


@dataclass(frozen=True)
class _RequestHead:
    method: str
    path: str
    query: dict[str, list[str]]
    target: str
    headers: list[tuple[str, str]]
    raw: bytes

    @classmethod
    def from_h11(cls, request: h11.Request, raw: bytes) -> _RequestHead:
        target = request.target.decode("latin-1")
        split = urlsplit(target)
        return cls(
            request.method.decode("latin-1"),
            split.path,
            parse_qs(split.query),
            target,
            [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers],
            raw,
        )

    def header(self, name: str) -> str:
        return ", ".join(self.headers_named(name))

    def headers_named(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name]


async def _respond(
    writer: asyncio.StreamWriter,
    http: h11.Connection,
    status: int,
    message: str,
    *,
    extra: list[tuple[str, str]] | None = None,
) -> None:
    body = (message + "\n").encode()
    headers = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        *(extra or []),
    ]
    try:
        data = http.send(h11.Response(status_code=status, headers=headers))
        data = (data or b"") + (http.send(h11.Data(data=body)) or b"")
        data += http.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        # h11 refuses once the request itself was unreadable; write the response by hand.
        reason = {400: "Bad Request", 403: "Forbidden", 404: "Not Found"}.get(status, "Error")
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    writer.write(data)
    await writer.drain()


class _SocketTransport:
    """The upgraded TCP/TLS connection as a SPDY byte transport."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: bytes
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._pending = pending

    async def read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        return await self._reader.read(65536)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close(self) -> None:
        # Half-close only: the read loop keeps draining what the peer still sends until it
        # closes too (the connection handler closes the socket in the end).
        if self._writer.can_write_eof():
            with contextlib.suppress(OSError):
                self._writer.write_eof()
        else:
            self._writer.close()
