"""Exec and port-forward end to end: the daemon's own Exec/PortForward RPCs hand out a URL,
and a SPDY client (as kubelet's proxy would) reaches a real pod through it, with and
without a user namespace of the pod's own."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cri_shim.api.v1 import api_pb2
from tests.harness import Daemon, userns_linux, wait_until
from tests.integration.cri_testkit import (
    container_config,
    create,
    exec_sync,
    import_image,
    pod,
    start,
)
from tests.integration.streaming.clients import (
    PORTFORWARD,
    SpdyClient,
    spdy_exec,
    spdy_forward_once,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

WEB_PORT = 8080
SERVE = (
    "mkdir -p /www && echo served-from-the-pod > /www/index.html && "
    f"exec httpd -f -p {WEB_PORT} -h /www"
)
POD_KINDS = {
    "host-users": {},
    "own-user-namespace": {"linux": userns_linux(65536 * 3400)},
}


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def _serving(daemon: Daemon, container_id: str) -> bool:
    probe = exec_sync(
        daemon, container_id, ["wget", "-q", "-O", "-", f"http://127.0.0.1:{WEB_PORT}/"]
    )
    return probe.exit_code == 0


async def _forward(url: str) -> tuple[bytes, bytes]:
    client = await SpdyClient.connect(url, [PORTFORWARD])
    try:
        return await spdy_forward_once(client, WEB_PORT, 0, b"GET / HTTP/1.0\r\n\r\n")
    finally:
        await client.close()


@pytest.mark.parametrize("kind", POD_KINDS)
def test_port_forward_reaches_the_pods_server(
    daemon: Daemon, image: None, short_tmp: Path, kind: str
) -> None:
    extra: dict[str, Any] = POD_KINDS[kind]
    with pod(daemon, f"fwd-{kind}", short_tmp, **extra) as p:
        container_id = create(daemon, p, container_config("web", SERVE))
        start(daemon, container_id)
        wait_until(lambda: _serving(daemon, container_id), timeout=10)
        url = (
            daemon.runtime()
            .PortForward(
                api_pb2.PortForwardRequest(pod_sandbox_id=p[0], port=[WEB_PORT]), timeout=10
            )
            .url
        )
        data, error = asyncio.run(_forward(url))
        assert error == b""
        assert data.split(b"\r\n", 1)[0].endswith(b"200 OK"), data
        assert data.endswith(b"served-from-the-pod\n")
    assert daemon.leaks() == {}


@pytest.mark.parametrize("kind", POD_KINDS)
def test_exec_runs_in_the_container_with_stdin(
    daemon: Daemon, image: None, short_tmp: Path, kind: str
) -> None:
    extra: dict[str, Any] = POD_KINDS[kind]
    with pod(daemon, f"exec-{kind}", short_tmp, **extra) as p:
        container_id = create(daemon, p, container_config("shell", "exec sleep 300"))
        start(daemon, container_id)
        request = api_pb2.ExecRequest(
            container_id=container_id,
            cmd=["sh", "-c", "id -u; awk '{print $1, $2, $3}' /proc/self/uid_map; tr a-z A-Z"],
            stdin=True,
            stdout=True,
            stderr=True,
        )
        url = daemon.runtime().Exec(request, timeout=10).url
        result = asyncio.run(spdy_exec(url, stdin=b"through stdin\n"))
        lines = result.stdout.decode().splitlines()
        mapped = "0 0 4294967295" if kind == "host-users" else f"0 {65536 * 3400} 65536"
        assert lines == ["0", mapped, "THROUGH STDIN"], result
        assert result.status == {"metadata": {}, "status": "Success"}, result
    assert daemon.leaks() == {}
