"""The URLs' tokens over HTTP: single use, expiry, kind, and requests that are not upgrades."""

from __future__ import annotations

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.streaming.server import StreamingServer
from tests.integration.streaming.clients import http_request, spdy_exec
from tests.integration.streaming.conftest import FakeClock

pytestmark = pytest.mark.integration


def echo_url(server: StreamingServer) -> str:
    return server.get_exec_url(
        api_pb2.ExecRequest(container_id="c1", cmd=["echo", "hi"], stdout=True)
    )


async def test_token_used_twice_is_refused(server: StreamingServer) -> None:
    url = echo_url(server)
    first = await spdy_exec(url, stderr=False)
    assert first.stdout == b"hi\n"

    status, body = await http_request(url)

    assert status == 404
    assert "unknown or expired token" in body


async def test_expired_token_is_refused(server: StreamingServer, clock: FakeClock) -> None:
    url = echo_url(server)
    clock.now += 61

    status, _ = await http_request(url)

    assert status == 404


async def test_token_just_before_expiry_still_works(
    server: StreamingServer, clock: FakeClock
) -> None:
    url = echo_url(server)
    clock.now += 59

    result = await spdy_exec(url, stderr=False)

    assert result.stdout == b"hi\n"


async def test_unknown_token_and_path_are_refused(server: StreamingServer) -> None:
    assert (await http_request(server.base_url + "/exec/not-a-token"))[0] == 404
    assert (await http_request(server.base_url + "/"))[0] == 404


async def test_token_of_another_kind_is_refused(server: StreamingServer) -> None:
    exec_token = echo_url(server).rsplit("/", 1)[1]

    status, _ = await http_request(f"{server.base_url}/attach/{exec_token}")

    assert status == 404


async def test_request_without_upgrade_is_refused(server: StreamingServer) -> None:
    status, body = await http_request(echo_url(server), upgrade=None)

    assert status == 400
    assert "Upgrade request required" in body
