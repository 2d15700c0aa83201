"""Port-forward through the streaming server to TCP echo servers on loopback.

Covers SPDY (`portforward.k8s.io`), SPDY tunnelled in a WebSocket (what kubectl 1.30+
sends) and `v4.channel.k8s.io` WebSocket channels: two ports at once, several
connections per port, and a port nobody listens on failing alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.streaming.server import StreamingServer
from tests.integration.streaming.clients import (
    PORTFORWARD,
    SpdyClient,
    WsPortForward,
    spdy_forward_once,
)
from tests.integration.streaming.conftest import EchoServer, free_port

pytestmark = pytest.mark.integration

StartEcho = Callable[[bytes], "asyncio.Future[EchoServer]"]


def forward_url(server: StreamingServer, *ports: int) -> str:
    return server.get_portforward_url(
        api_pb2.PortForwardRequest(pod_sandbox_id="pod1", port=list(ports))
    )


@pytest.mark.parametrize("transport", ["spdy", "spdy-in-websocket"])
async def test_two_ports_several_connections_each(
    server: StreamingServer, echo_servers: StartEcho, transport: str
) -> None:
    alpha, beta = await echo_servers(b"alpha"), await echo_servers(b"beta")
    url = forward_url(server, alpha.port, beta.port)
    client = await (
        SpdyClient.connect(url, [PORTFORWARD])
        if transport == "spdy"
        else SpdyClient.over_websocket(url)
    )
    try:
        assert client.protocol in (PORTFORWARD, "SPDY/3.1+portforward.k8s.io")
        jobs = [
            spdy_forward_once(client, echo.port, request_id, b"payload-%d" % request_id)
            for request_id, echo in enumerate([alpha, beta] * 3)
        ]
        results = await asyncio.gather(*jobs)
    finally:
        await client.close()

    for request_id, (data, error) in enumerate(results):
        tag = b"alpha" if request_id % 2 == 0 else b"beta"
        assert data == tag + b":payload-%d" % request_id
        assert error == b""
    assert alpha.connections == 3
    assert beta.connections == 3


async def test_spdy_refused_port_errors_alone(
    server: StreamingServer, echo_servers: StartEcho
) -> None:
    echo = await echo_servers(b"up")
    closed = free_port()
    client = await SpdyClient.connect(forward_url(server), [PORTFORWARD])
    try:
        refused, working = await asyncio.gather(
            spdy_forward_once(client, closed, 1, b"lost"),
            spdy_forward_once(client, echo.port, 2, b"kept"),
        )
        # The session survives the failure: a later connection works too.
        again = await spdy_forward_once(client, echo.port, 3, b"again")
    finally:
        await client.close()

    assert refused[0] == b""
    assert refused[1].startswith(b"error forwarding port %d to pod pod1:" % closed)
    assert working == (b"up:kept", b"")
    assert again == (b"up:again", b"")


async def test_spdy_large_transfer_both_ways(
    server: StreamingServer, echo_servers: StartEcho
) -> None:
    echo = await echo_servers(b"big")
    payload = bytes(range(256)) * 8192  # 2 MiB, far beyond every flow control window
    client = await SpdyClient.connect(forward_url(server, echo.port), [PORTFORWARD])
    try:
        data, error = await spdy_forward_once(client, echo.port, 0, payload)
    finally:
        await client.close()

    assert data == b"big:" + payload
    assert error == b""


async def test_port_outside_the_requested_ones_is_refused(
    server: StreamingServer, echo_servers: StartEcho
) -> None:
    allowed, other = await echo_servers(b"a"), await echo_servers(b"b")
    client = await SpdyClient.connect(forward_url(server, allowed.port), [PORTFORWARD])
    try:
        data, error = await spdy_forward_once(client, other.port, 0, b"x")
    finally:
        await client.close()

    assert data == b""
    assert b"was not requested" in error
    assert other.connections == 0


async def test_websocket_v4_channels_per_port(
    server: StreamingServer, echo_servers: StartEcho
) -> None:
    one, two = await echo_servers(b"one"), await echo_servers(b"two")
    closed = free_port()
    forward = await WsPortForward.start(forward_url(server, one.port, closed, two.port), [])
    try:
        await forward.send(0, b"to-one")
        await forward.send(2, b"to-two")
        got_one = await forward.wait_for(0, lambda data: data.endswith(b"to-one"))
        got_two = await forward.wait_for(4, lambda data: data.endswith(b"to-two"))
        error = await forward.wait_for(3, lambda data: b"error forwarding" in data)
    finally:
        await forward.close()

    # Every channel starts with its port, little-endian.
    assert forward.prefixes == {
        0: one.port, 1: one.port, 2: closed, 3: closed, 4: two.port, 5: two.port
    }  # fmt: skip
    assert got_one == b"one:to-one"
    assert got_two == b"two:to-two"
    assert b"port %d" % closed in error
    assert forward.data[1] == b"" and forward.data[5] == b""
