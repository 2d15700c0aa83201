"""The real kubectl as an independent client: its WebSocket and SPDY code is Go's, not ours.

kubectl talks to a stand-in API server (kubectl_proxy.py) that passes each upgrade through
to a streaming URL. `KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false` and
`KUBECTL_PORT_FORWARD_WEBSOCKETS=false` make it fall back to plain SPDY.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.streaming.server import StreamingServer
from cri_shim.streaming.terminal import set_window_size
from tests.integration.streaming.conftest import EchoServer
from tests.integration.streaming.kubectl_proxy import KUBECTL, POD, FakeApiServer, kubectl

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed"),
]

BUSYBOX = shutil.which("busybox")
EXEC_MODES = {"websocket": "true", "spdy": "false"}


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[FakeApiServer]:
    made = FakeApiServer()
    await made.start()
    yield made
    await made.stop()


async def run(argv: list[str], env: dict[str, str], stdin: bytes = b"") -> tuple[int, bytes, bytes]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out, err


@pytest.mark.parametrize("mode", EXEC_MODES)
async def test_kubectl_exec_streams_and_exit_code(
    server: StreamingServer, api: FakeApiServer, tmp_path: Path, mode: str
) -> None:
    api.target = server.get_exec_url(
        api_pb2.ExecRequest(
            container_id="c1",
            # kubectl's WebSocket client reads before it has made its streams and drops
            # what comes for one it has not made yet ("Unknown stream id 1, discarding
            # message"): the command waits for it, as the tty case below does.
            cmd=[
                "sh",
                "-c",
                "sleep 0.3; echo out; echo err >&2; head -c 300000 /dev/zero | tr '\\0' x; exit 3",
            ],
            stdout=True,
            stderr=True,
        )
    )
    env = dict(os.environ, KUBECTL_REMOTE_COMMAND_WEBSOCKETS=EXEC_MODES[mode])

    code, out, err = await run(kubectl(api.kubeconfig(tmp_path), "exec", POD, "--", "x"), env)

    assert code == 3, err
    assert out == b"out\n" + b"x" * 300_000
    assert err.startswith(b"err\n")
    assert b"command terminated with exit code 3" in err


@pytest.mark.parametrize("mode", EXEC_MODES)
async def test_kubectl_exec_stdin(
    server: StreamingServer, api: FakeApiServer, tmp_path: Path, mode: str
) -> None:
    api.target = server.get_exec_url(
        api_pb2.ExecRequest(container_id="c1", cmd=["cat"], stdin=True, stdout=True, stderr=True)
    )
    env = dict(os.environ, KUBECTL_REMOTE_COMMAND_WEBSOCKETS=EXEC_MODES[mode])
    payload = b"".join(b"line %d\n" % i for i in range(30000))

    code, out, err = await run(
        kubectl(api.kubeconfig(tmp_path), "exec", "-i", POD, "--", "cat"), env, payload
    )

    assert code == 0, err
    assert out == payload


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
@pytest.mark.parametrize("mode", EXEC_MODES)
async def test_kubectl_exec_tty_gets_the_terminal_size(
    server: StreamingServer, api: FakeApiServer, tmp_path: Path, mode: str
) -> None:
    assert BUSYBOX is not None
    api.target = server.get_exec_url(
        api_pb2.ExecRequest(
            container_id="c1",
            cmd=[BUSYBOX, "sh", "-c", "sleep 0.5; stty size"],
            stdin=True,
            stdout=True,
            tty=True,
        )
    )
    env = dict(os.environ, KUBECTL_REMOTE_COMMAND_WEBSOCKETS=EXEC_MODES[mode])
    env.pop("LINES", None)
    env.pop("COLUMNS", None)
    master, slave = os.openpty()
    set_window_size(master, 91, 27)  # kubectl sends its terminal's size to the container
    try:
        process = await asyncio.create_subprocess_exec(
            *kubectl(api.kubeconfig(tmp_path), "exec", "-it", POD, "--", "sh"),
            stdin=slave,
            stdout=slave,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        os.close(slave)
        slave = -1
        output = await asyncio.wait_for(asyncio.to_thread(_read_until_closed, master), 60)
        await asyncio.wait_for(process.wait(), 30)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert b"27 91" in output


def _read_until_closed(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO once kubectl, the last holder of the slave, exits
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("websockets", ["true", "false"])
async def test_kubectl_port_forward_two_ports(
    server: StreamingServer,
    api: FakeApiServer,
    tmp_path: Path,
    echo_servers: Callable[[bytes], asyncio.Future[EchoServer]],
    websockets: str,
) -> None:
    first, second = await echo_servers(b"first"), await echo_servers(b"second")
    api.target = server.get_portforward_url(
        api_pb2.PortForwardRequest(pod_sandbox_id="pod1", port=[first.port, second.port])
    )
    env = dict(os.environ, KUBECTL_PORT_FORWARD_WEBSOCKETS=websockets)
    process = await asyncio.create_subprocess_exec(
        *kubectl(
            api.kubeconfig(tmp_path), "port-forward", POD, f":{first.port}", f":{second.port}"
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        local = {}
        while len(local) < 2:
            line = await asyncio.wait_for(process.stdout.readline(), 30)
            assert line, "kubectl port-forward ended early"
            if match := re.match(rb"Forwarding from 127\.0\.0\.1:(\d+) -> (\d+)", line):
                local[int(match[2])] = int(match[1])

        async def roundtrip(remote: int, text: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", local[remote])
            writer.write(text)
            writer.write_eof()
            try:
                return await asyncio.wait_for(reader.read(), 20)
            finally:
                writer.close()

        for attempt in range(3):  # several connections per port through one session
            results = await asyncio.gather(
                roundtrip(first.port, b"a%d" % attempt), roundtrip(second.port, b"b%d" % attempt)
            )
            assert results == [b"first:a%d" % attempt, b"second:b%d" % attempt]
    finally:
        process.terminate()
        await process.wait()
    assert first.connections == 3
    assert second.connections == 3
