"""Exec, attach and port-forward end to end: the daemon's own Exec/Attach/PortForward RPCs
hand out a URL, and a SPDY client (as kubelet's proxy would) reaches a real pod through
it, with and without a user namespace of the pod's own, in the host's network, and under
a long run root."""

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
    output,
    pod,
    start,
    status,
)
from tests.integration.streaming.clients import (
    PORTFORWARD,
    SpdyClient,
    spdy_exec,
    spdy_forward_once,
)
from tests.registry import free_port

pytestmark = [pytest.mark.integration, pytest.mark.root]

WEB_PORT = 8080


def serve(address: str) -> str:
    return (
        "mkdir -p /www && echo served-from-the-pod > /www/index.html && "
        f"exec httpd -f -p {address} -h /www"
    )


POD_KINDS = {
    "host-users": {},
    "own-user-namespace": {"linux": userns_linux(65536 * 3400)},
}


@pytest.fixture
def image(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)


def _serving(daemon: Daemon, container_id: str, port: int = WEB_PORT) -> bool:
    probe = exec_sync(daemon, container_id, ["wget", "-q", "-O", "-", f"http://127.0.0.1:{port}/"])
    return probe.exit_code == 0


async def _forward(url: str, port: int = WEB_PORT) -> tuple[bytes, bytes]:
    client = await SpdyClient.connect(url, [PORTFORWARD])
    try:
        return await spdy_forward_once(client, port, 0, b"GET / HTTP/1.0\r\n\r\n")
    finally:
        await client.close()


def _forward_to_pod(daemon: Daemon, sandbox_id: str, port: int) -> bytes:
    request = api_pb2.PortForwardRequest(pod_sandbox_id=sandbox_id, port=[port])
    url = daemon.runtime().PortForward(request, timeout=10).url
    data, error = asyncio.run(_forward(url, port))
    assert error == b""
    assert data.split(b"\r\n", 1)[0].endswith(b"200 OK"), data
    return data


@pytest.mark.parametrize("kind", POD_KINDS)
def test_port_forward_reaches_the_pods_server(
    daemon: Daemon, image: None, short_tmp: Path, kind: str
) -> None:
    extra: dict[str, Any] = POD_KINDS[kind]
    with pod(daemon, f"fwd-{kind}", short_tmp, **extra) as p:
        container_id = create(daemon, p, container_config("web", serve(str(WEB_PORT))))
        start(daemon, container_id)
        wait_until(lambda: _serving(daemon, container_id), timeout=10)
        assert _forward_to_pod(daemon, p[0], WEB_PORT).endswith(b"served-from-the-pod\n")
    assert daemon.leaks() == {}


def test_port_forward_to_a_host_network_pod_dials_the_host(
    daemon: Daemon, image: None, short_tmp: Path
) -> None:
    # The pod has no network namespace of its own: its server listens in the host's, on
    # loopback, where the daemon must dial (critest: "portforward in host network").
    port = free_port()
    host_network = api_pb2.LinuxPodSandboxConfig(
        security_context=api_pb2.LinuxSandboxSecurityContext(
            namespace_options=api_pb2.NamespaceOption(network=api_pb2.NODE)
        )
    )
    with pod(daemon, "fwd-host-network", short_tmp, linux=host_network) as p:
        config = container_config("web", serve(f"127.0.0.1:{port}"))
        container_id = create(daemon, p, config)
        start(daemon, container_id)
        wait_until(lambda: _serving(daemon, container_id, port), timeout=10)
        assert _forward_to_pod(daemon, p[0], port).endswith(b"served-from-the-pod\n")
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


# Without `--full-attach`, conmon links the bundle as <run_root>/conmon/runc/sockets/<id>
# and binds `attach` in it; when that link's path is 107 bytes long (a 22-byte run_root),
# it cuts the link's name one character short, and the socket was not where the daemon
# looked ("No such file or directory"). A run_root past sun_path's 108 bytes must work too.
@pytest.mark.parametrize("run_root_length", [22, 150])
def test_attach_under_a_long_run_root(
    make_daemon: Any, short_tmp: Path, busybox_layout: Path, run_root_length: int
) -> None:
    run_root = short_tmp / ("r" * (run_root_length - len(str(short_tmp)) - 1))
    assert len(str(run_root)) == run_root_length
    daemon: Daemon = make_daemon(run_dir=run_root)
    daemon.start()
    import_image(daemon, busybox_layout)
    with pod(daemon, "attach", short_tmp) as p:
        config = container_config("echo", "echo ready; exec cat", stdin=True, stdin_once=True)
        container_id = create(daemon, p, config)
        start(daemon, container_id)
        wait_until(lambda: output(status(daemon, container_id)) == ["ready"], timeout=10)
        request = api_pb2.AttachRequest(
            container_id=container_id, stdin=True, stdout=True, stderr=True
        )
        url = daemon.runtime().Attach(request, timeout=10).url
        # stdin_once: the end of the client's stdin is the end of the container's.
        result = asyncio.run(spdy_exec(url, stdin=b"through attach\n"))
        assert result.stdout == b"through attach\n", result
        assert result.status == {"metadata": {}, "status": "Success"}, result
        exited = wait_until(
            lambda: (s := status(daemon, container_id)).state == api_pb2.CONTAINER_EXITED and s,
            timeout=10,
        )
        assert exited.exit_code == 0 and output(exited) == ["ready", "through attach"]
    assert daemon.leaks() == {}
    assert daemon.runc_containers() == []
