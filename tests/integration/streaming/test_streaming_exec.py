"""Exec and attach through the streaming server, over SPDY and WebSocket, with real processes.

The backend is ProcessTestBackend (host processes with pipes or a real pty), so these tests
cover the protocols without root; tests/integration/streaming/test_streaming_runc.py runs
the same paths against runc containers.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import InvalidArgument
from cri_shim.streaming.server import StreamingServer
from tests.integration.streaming.clients import (
    V1,
    V2,
    V3,
    V4,
    V5,
    SpdyCommand,
    UpgradeRefused,
    WsCommand,
    spdy_exec,
    ws_command,
)
from tests.integration.streaming.process_backend import ProcessTestBackend

pytestmark = pytest.mark.integration

BUSYBOX = shutil.which("busybox")
ECHO_BOTH = ["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"]


def exec_url(server: StreamingServer, cmd: list[str], **flags: bool) -> str:
    flags.setdefault("stdout", True)
    flags.setdefault("stderr", not flags.get("tty", False))
    return server.get_exec_url(api_pb2.ExecRequest(container_id="c1", cmd=cmd, **flags))


def exit_code(status: dict[str, object] | None) -> int:
    """The exit code as kubectl reads it from a v4 status."""
    assert status is not None
    if status["status"] == "Success":
        return 0
    assert status["reason"] == "NonZeroExitCode"
    causes = status["details"]["causes"]  # type: ignore[index]
    return int(next(c["message"] for c in causes if c["reason"] == "ExitCode"))


async def wait_until(predicate: object, limit: float = 10.0) -> None:
    async def poll() -> None:
        # Polling on purpose: the states watched (a process exit, a backend's record)
        # have no event to wait on from the test's side.
        while not predicate():  # type: ignore[operator]  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), limit)


# -- SPDY ------------------------------------------------------------------------------------


async def test_spdy_exec_keeps_stdout_and_stderr_apart_and_reports_exit_code(
    server: StreamingServer,
) -> None:
    result = await spdy_exec(exec_url(server, ECHO_BOTH))

    assert result.stdout == b"to-stdout\n"
    assert result.stderr == b"to-stderr\n"
    assert result.status == {
        "metadata": {},
        "status": "Failure",
        "message": "command terminated with non-zero exit code: exit status 3",
        "reason": "NonZeroExitCode",
        "details": {"causes": [{"reason": "ExitCode", "message": "3"}]},
    }


async def test_spdy_exec_success_writes_success_status(server: StreamingServer) -> None:
    result = await spdy_exec(exec_url(server, ["echo", "fine"]))

    assert result.stdout == b"fine\n"
    assert result.status == {"metadata": {}, "status": "Success"}


@pytest.mark.parametrize("protocol", [V3, V2, V1])
async def test_spdy_before_v4_reports_failure_as_plain_text(
    server: StreamingServer, protocol: str
) -> None:
    failed = await spdy_exec(exec_url(server, ECHO_BOTH), protocols=[protocol])
    succeeded = await spdy_exec(exec_url(server, ["true"]), protocols=[protocol])

    assert failed.stdout == b"to-stdout\n"
    assert failed.error == b"command terminated with non-zero exit code: exit status 3"
    assert succeeded.error == b""


async def test_spdy_negotiates_the_clients_first_supported_protocol(
    server: StreamingServer,
) -> None:
    command = await SpdyCommand.start(
        exec_url(server, ["true"]), protocols=["v9.channel.k8s.io", V3, V4]
    )
    try:
        assert command.client.protocol == V3
    finally:
        await command.close()


async def test_spdy_refuses_when_no_protocol_is_common(server: StreamingServer) -> None:
    with pytest.raises(UpgradeRefused) as refused:
        await SpdyCommand.start(exec_url(server, ["true"]), protocols=["v9.channel.k8s.io"])

    assert refused.value.status == 403
    assert "unable to negotiate protocol" in refused.value.body


async def test_spdy_stdin_close_ends_cat(server: StreamingServer) -> None:
    payload = b"".join(b"line %d\n" % i for i in range(20000))  # well past the 64 KiB window

    result = await spdy_exec(exec_url(server, ["cat"], stdin=True), stdin=payload)

    assert result.stdout == payload
    assert result.status == {"metadata": {}, "status": "Success"}


async def test_spdy_large_output_arrives_whole(server: StreamingServer) -> None:
    result = await spdy_exec(exec_url(server, ["sh", "-c", "head -c 3000000 /dev/zero"]))

    assert result.stdout == b"\0" * 3_000_000


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
async def test_spdy_tty_shell_sees_resizes_and_exit_code(
    server: StreamingServer, backend: ProcessTestBackend
) -> None:
    assert BUSYBOX is not None
    command = await SpdyCommand.start(
        exec_url(server, [BUSYBOX, "sh"], stdin=True, tty=True), stdin=True, stderr=False, tty=True
    )
    try:
        await command.resize(100, 40)
        await wait_until(lambda: backend.execs and (100, 40) in backend.execs[0].resizes)
        await command.send(b"stty size; echo marker-$((6*7))\n")
        await command.wait_for(b"marker-42")
        assert b"40 100" in command.output["stdout"], backend.execs[0].resizes

        await command.resize(123, 45)
        await wait_until(lambda: (123, 45) in backend.execs[0].resizes)
        await command.send(b"stty size\n")
        await command.wait_for(b"45 123")

        await command.send(b"exit 7\n")
        result = await command.result()
    finally:
        await command.close()
    assert exit_code(result.status) == 7
    assert result.stderr == b""


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
async def test_spdy_tty_stdin_close_sends_end_of_file(server: StreamingServer) -> None:
    assert BUSYBOX is not None
    command = await SpdyCommand.start(
        exec_url(server, [BUSYBOX, "cat"], stdin=True, tty=True), stdin=True, stderr=False, tty=True
    )
    try:
        await command.send(b"typed\n")
        await command.wait_for(b"typed")
        await command.close_stdin()
        result = await command.result()
    finally:
        await command.close()
    assert exit_code(result.status) == 0


async def test_spdy_client_going_away_kills_the_command(
    server: StreamingServer, backend: ProcessTestBackend
) -> None:
    command = await SpdyCommand.start(
        exec_url(server, ["sh", "-c", "echo started; exec sleep 600"])
    )
    await command.wait_for(b"started")

    await command.close()

    await wait_until(lambda: backend.execs[0].process.returncode is not None)


async def test_exec_of_a_missing_container_reports_on_the_error_stream(
    server: StreamingServer,
) -> None:
    url = server.get_exec_url(
        api_pb2.ExecRequest(container_id="missing", cmd=["true"], stdout=True)
    )

    result = await spdy_exec(url, stderr=False)

    assert result.status is not None
    assert result.status["status"] == "Failure"
    assert "container missing not found" in result.status["message"]


# -- WebSocket -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [V5, V4])
async def test_websocket_exec_keeps_streams_apart_and_reports_exit_code(
    server: StreamingServer, protocol: str
) -> None:
    async with ws_command(exec_url(server, ECHO_BOTH), [protocol]) as command:
        assert command.protocol == protocol
        result = await command.result()

    assert result.stdout == b"to-stdout\n"
    assert result.stderr == b"to-stderr\n"
    assert exit_code(result.status) == 3


async def test_websocket_v5_close_frame_ends_stdin(server: StreamingServer) -> None:
    async with ws_command(exec_url(server, ["cat"], stdin=True), [V5]) as command:
        await command.send(b"first\n")
        await command.send(b"second\n")
        await command.close_stdin()
        result = await command.result()

    assert result.stdout == b"first\nsecond\n"
    assert exit_code(result.status) == 0


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
@pytest.mark.parametrize("protocol", [V5, V4])
async def test_websocket_tty_shell_resize(
    server: StreamingServer, backend: ProcessTestBackend, protocol: str
) -> None:
    assert BUSYBOX is not None
    url = exec_url(server, [BUSYBOX, "sh"], stdin=True, tty=True)
    async with ws_command(url, [protocol]) as command:
        await command.resize(90, 33)
        await wait_until(lambda: backend.execs and (90, 33) in backend.execs[0].resizes)
        await command.send(b"stty size\n")
        await command.wait_for(b"33 90")
        await command.send(b"exit 4\n")
        result = await command.result()

    assert exit_code(result.status) == 4


async def test_websocket_client_going_away_kills_the_command(
    server: StreamingServer, backend: ProcessTestBackend
) -> None:
    command = await WsCommand.start(exec_url(server, ["sh", "-c", "echo started; exec sleep 600"]))
    await command.wait_for(b"started")

    await command.close()

    await wait_until(lambda: backend.execs[0].process.returncode is not None)


# -- attach ----------------------------------------------------------------------------------


def attach_url(server: StreamingServer, container_id: str, **flags: bool) -> str:
    return server.get_attach_url(api_pb2.AttachRequest(container_id=container_id, **flags))


async def test_attach_echoes_stdin_detaches_and_ends_with_the_container(
    server: StreamingServer, backend: ProcessTestBackend
) -> None:
    container = await backend.start_container("cat1", ["cat"], tty=False)

    first = await SpdyCommand.start(
        attach_url(server, "cat1", stdin=True, stdout=True, stderr=True), stdin=True
    )
    await first.send(b"one\n")
    await first.wait_for(b"one\n")
    await first.close()  # detach: the container goes on
    await asyncio.sleep(0.2)
    assert container.process.returncode is None

    async with ws_command(attach_url(server, "cat1", stdin=True, stdout=True), [V5]) as second:
        await second.send(b"two\n")
        await second.wait_for(b"two\n")
        await second.close_stdin()  # cat ends, and so does the attach
        result = await second.result()

    assert result.status == {"metadata": {}, "status": "Success"}
    await wait_until(lambda: container.process.returncode is not None)
    assert container.process.returncode == 0


@pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")
async def test_attach_tty_resizes_the_containers_terminal(
    server: StreamingServer, backend: ProcessTestBackend
) -> None:
    assert BUSYBOX is not None
    container = await backend.start_container("sh1", [BUSYBOX, "sh"], tty=True)
    url = attach_url(server, "sh1", stdin=True, stdout=True, tty=True)
    command = await SpdyCommand.start(url, stdin=True, stderr=False, tty=True)
    try:
        await command.resize(77, 22)
        await wait_until(lambda: (77, 22) in container.resizes)
        await command.send(b"stty size\n")
        await command.wait_for(b"22 77")
    finally:
        await command.close()


async def test_attach_to_a_missing_container_reports_on_the_error_stream(
    server: StreamingServer,
) -> None:
    result = await spdy_exec(attach_url(server, "nobody", stdout=True), stderr=False)

    assert result.status is not None and result.status["status"] == "Failure"
    assert "not found" in json.dumps(result.status)


# -- URL validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"cmd": ["ls"]}, "one of stdin, stdout, or stderr"),
        ({"cmd": ["ls"], "stdout": True, "stderr": True, "tty": True}, "tty and stderr"),
        ({"stdout": True}, "cmd is required"),
    ],
)
def test_exec_url_validates_the_request(
    server: StreamingServer, request_fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        server.get_exec_url(api_pb2.ExecRequest(container_id="c1", **request_fields))


def test_attach_url_validates_the_request(server: StreamingServer) -> None:
    with pytest.raises(InvalidArgument, match="tty and stderr"):
        server.get_attach_url(
            api_pb2.AttachRequest(container_id="c1", stdout=True, stderr=True, tty=True)
        )


def test_urls_point_at_the_server(server: StreamingServer) -> None:
    url = exec_url(server, ["ls"])

    assert url.startswith(server.base_url + "/exec/")
    assert url.startswith("http://127.0.0.1:")
