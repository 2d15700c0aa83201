"""RuncStreamingBackend against a real runc container (root): exec, a TTY shell, port-forward.

The container is as small as it gets: a rootfs of static busybox and its applet links, an
OCI config written here (pid, mount, ipc and uts namespaces, plus a network namespace made
with `ip netns add`, where busybox httpd listens on 127.0.0.1), created and started with
`runc create` + `runc start` and stdio on /dev/null. Teardown kills and deletes the
container and removes the namespace, whatever the test did.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cri_shim.api.v1 import api_pb2
from cri_shim.errors import NotFound
from cri_shim.host.process import set_child_subreaper
from cri_shim.streaming.backend import ContainerEndpoint
from cri_shim.streaming.runc_backend import RuncStreamingBackend
from cri_shim.streaming.server import StreamingConfig, StreamingServer
from tests.integration.streaming.clients import (
    PORTFORWARD,
    SpdyClient,
    SpdyCommand,
    spdy_exec,
    spdy_forward_once,
    ws_command,
)

pytestmark = [pytest.mark.integration, pytest.mark.root]

RUNC = shutil.which("runc")
BUSYBOX = Path("/bin/busybox")
APPLETS = [
    "sh",
    "tty",
    "hostname",
    "cat",
    "echo",
    "sleep",
    "stty",
    "httpd",
    "ps",
    "true",
    "head",
    "tr",
    "ls",
]
HTTP_PORTS = (8080, 8081)

if RUNC is None or not BUSYBOX.exists() or shutil.which("ip") is None:
    pytestmark.append(pytest.mark.skip(reason="needs runc, static busybox and iproute2"))


@dataclass
class Container:
    container_id: str
    runtime_root: Path
    netns: Path


def _write_bundle(bundle: Path, netns: Path | None, args: list[str] | None = None) -> None:
    rootfs = bundle / "rootfs"
    for directory in ("bin", "proc", "dev", "sys", "tmp", "www0", "www1"):
        (rootfs / directory).mkdir(parents=True)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    for index in (0, 1):
        (rootfs / f"www{index}" / "index.html").write_text(
            f"served from port {HTTP_PORTS[index]}\n"
        )
    start = " && ".join(
        f"httpd -p 127.0.0.1:{port} -h /www{index}" for index, port in enumerate(HTTP_PORTS)
    )
    config = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args or ["/bin/sh", "-c", f"{start} && exec sleep 100000"],
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": "streamed",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "mount"},
                {"type": "ipc"},
                {"type": "uts"},
                *([{"type": "network", "path": str(netns)}] if netns else []),
            ],
        },
    }
    (bundle / "config.json").write_text(json.dumps(config))


def _wait_for_listeners(netns_name: str, ports: tuple[int, ...]) -> None:
    """runc start returns before httpd listens; /proc/net/tcp in the netns tells when it does."""
    wanted = {f"0100007F:{port:04X}" for port in ports}
    for _ in range(100):
        table = subprocess.run(
            ["ip", "netns", "exec", netns_name, "cat", "/proc/net/tcp"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        listening = {line.split()[1] for line in table.splitlines()[1:] if line.split()[3] == "0A"}
        if wanted <= listening:
            return
        time.sleep(0.1)
    raise AssertionError(f"httpd did not start listening on {ports} in the pod")


@pytest.fixture
def container(short_tmp: Path) -> Iterator[Container]:
    assert RUNC is not None
    name = f"cs-stream-{uuid.uuid4().hex[:8]}"
    netns = Path("/run/netns") / name
    subprocess.run(["ip", "netns", "add", name], check=True)
    runtime_root = short_tmp / "runc"
    made = Container(name, runtime_root, netns)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        bundle = short_tmp / "bundle"
        _write_bundle(bundle, netns)
        runc = [RUNC, "--root", str(runtime_root)]
        quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "check": True}
        subprocess.run([*runc, "create", "--bundle", str(bundle), name], **quiet, timeout=30)  # type: ignore[call-overload]
        subprocess.run([*runc, "start", name], **quiet, timeout=30)  # type: ignore[call-overload]
        _wait_for_listeners(name, HTTP_PORTS)
        yield made
    finally:
        if RUNC is not None:
            runc = [RUNC, "--root", str(runtime_root)]
            subprocess.run([*runc, "kill", name, "KILL"], capture_output=True, check=False)
            subprocess.run([*runc, "delete", "--force", name], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)


@pytest.fixture
async def runc_server(container: Container, short_tmp: Path) -> AsyncIterator[StreamingServer]:
    assert RUNC is not None

    def resolve_container(container_id: str) -> ContainerEndpoint:
        if container_id != container.container_id:
            raise NotFound(f"container {container_id} not found")
        return ContainerEndpoint(
            runtime_path=Path(RUNC),
            runtime_root=container.runtime_root,
            attach_socket=short_tmp / "no-conmon" / "attach",
            control_fifo=short_tmp / "no-conmon" / "ctl",
            running=True,
        )

    def resolve_netns(sandbox_id: str) -> Path:
        return container.netns

    backend = RuncStreamingBackend(resolve_container, resolve_netns, work_dir=short_tmp)
    server = StreamingServer(StreamingConfig(stream_creation_timeout=5.0), backend)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        _stop_being_subreaper()


def _stop_being_subreaper() -> None:
    """TTY execs make the process a child subreaper (as the daemon is); undo it for the
    rest of the test session and reap whatever was re-parented to us meanwhile."""
    set_child_subreaper(False)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


CONMON = shutil.which("conmon")
ECHO_LINES = 'while read line; do echo "out:$line"; echo "err:$line" >&2; done; echo bye'


@pytest.fixture
def conmon_container(short_tmp: Path) -> Iterator[tuple[str, Path, Path]]:
    """A container run by conmon with stdin open: (id, runc root, conmon socket dir)."""
    if CONMON is None:
        pytest.skip("conmon is not installed")
    assert RUNC is not None
    name = f"cs-attach-{uuid.uuid4().hex[:8]}"
    bundle, root = short_tmp / "abundle", short_tmp / "aroot"
    sockets, exits = short_tmp / "sockets", short_tmp / "exits"
    for directory in (sockets, exits):
        directory.mkdir()
    _write_bundle(bundle, None, ["/bin/sh", "-c", ECHO_LINES])
    conmon = [
        CONMON, "--api-version", "1", "-c", name, "-u", name, "-n", name, "-r", RUNC,
        "-b", str(bundle), "-p", str(bundle / "pidfile"),
        "--conmon-pidfile", str(bundle / "conmon.pid"), "--exit-dir", str(exits),
        "--socket-dir-path", str(sockets), "-l", f"k8s-file:{bundle / 'log'}",
        "--runtime-arg", f"--root={root}", "--stdin",
    ]  # fmt: skip
    try:
        subprocess.run(
            conmon, stdin=subprocess.DEVNULL, capture_output=True, check=True, timeout=30
        )
        # Without a sync pipe conmon returns before its `runc create` is done.
        for _ in range(100):
            state = subprocess.run(
                [RUNC, "--root", str(root), "state", name], capture_output=True, check=False
            )
            if b'"created"' in state.stdout:
                break
            time.sleep(0.1)
        subprocess.run([RUNC, "--root", str(root), "start", name], check=True, timeout=30)
        yield name, root, sockets
    finally:
        subprocess.run(
            [RUNC, "--root", str(root), "kill", name, "KILL"], capture_output=True, check=False
        )
        subprocess.run(
            [RUNC, "--root", str(root), "delete", "--force", name], capture_output=True, check=False
        )
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((bundle / "conmon.pid").read_text()), 9)


async def test_attach_through_conmons_socket(
    conmon_container: tuple[str, Path, Path], short_tmp: Path
) -> None:
    name, root, sockets = conmon_container
    assert RUNC is not None
    endpoint = ContainerEndpoint(
        Path(RUNC), root, sockets / name / "attach", short_tmp / "abundle" / "ctl", running=True
    )
    backend = RuncStreamingBackend(lambda _: endpoint, lambda _: Path("/nonexistent"))
    server = StreamingServer(StreamingConfig(), backend)
    await server.start()
    try:
        url = server.get_attach_url(
            api_pb2.AttachRequest(container_id=name, stdin=True, stdout=True, stderr=True)
        )
        command = await SpdyCommand.start(url, stdin=True)
        try:
            await command.send(b"hello\n")
            await command.wait_for(b"out:hello\n")
            await command.wait_for(b"err:hello\n", "stderr")
            await command.close_stdin()  # conmon closes the container's stdin; the loop ends
            result = await command.result()
        finally:
            await command.close()
    finally:
        await server.stop()

    assert result.stdout == b"out:hello\nbye\n"
    assert result.stderr == b"err:hello\n"
    assert result.status == {"metadata": {}, "status": "Success"}


def exec_url(server: StreamingServer, container: Container, cmd: list[str], **flags: bool) -> str:
    flags.setdefault("stdout", True)
    flags.setdefault("stderr", not flags.get("tty", False))
    request = api_pb2.ExecRequest(container_id=container.container_id, cmd=cmd, **flags)
    return server.get_exec_url(request)


async def test_exec_echo_in_the_container(
    runc_server: StreamingServer, container: Container
) -> None:
    cmd = ["sh", "-c", "echo $(hostname) out; echo err >&2; exit 5"]

    result = await spdy_exec(exec_url(runc_server, container, cmd))

    assert result.stdout == b"streamed out\n"
    assert result.stderr == b"err\n"
    assert result.status is not None
    assert result.status["details"]["causes"] == [{"reason": "ExitCode", "message": "5"}]


async def test_exec_stdin_close_ends_cat_over_websocket(
    runc_server: StreamingServer, container: Container
) -> None:
    url = exec_url(runc_server, container, ["cat"], stdin=True)
    async with ws_command(url) as command:
        await command.send(b"through runc\n")
        await command.close_stdin()
        result = await command.result()

    assert result.stdout == b"through runc\n"
    assert result.status == {"metadata": {}, "status": "Success"}


async def test_interactive_tty_shell_with_resize(
    runc_server: StreamingServer, container: Container
) -> None:
    url = exec_url(runc_server, container, ["sh"], stdin=True, tty=True)
    command = await SpdyCommand.start(url, stdin=True, stderr=False, tty=True)
    try:
        await command.resize(132, 43)
        await command.send(b"stty size; tty; echo done-$((40+2))\n")
        await command.wait_for(b"done-42")
        await command.resize(80, 25)
        await command.send(b"stty size\n")
        await command.wait_for(b"25 80")
        await command.send(b"exit 9\n")
        result = await command.result()
    finally:
        await command.close()

    assert b"43 132" in result.stdout
    assert b"/dev/pts/" in result.stdout  # a terminal inside the container
    assert result.status is not None
    assert result.status["details"]["causes"][0]["message"] == "9"


async def test_client_going_away_kills_the_exec(
    runc_server: StreamingServer, container: Container
) -> None:
    command = await SpdyCommand.start(
        exec_url(runc_server, container, ["sh", "-c", "echo started; exec sleep 4242"])
    )
    await command.wait_for(b"started")

    await command.close()

    async def sleeper_gone() -> None:
        while True:
            listing = await spdy_exec(exec_url(runc_server, container, ["ps"]))
            if b"sleep 4242" not in listing.stdout:
                return
            await asyncio.sleep(0.2)

    await asyncio.wait_for(sleeper_gone(), 15)


async def test_port_forward_into_the_pod_network_namespace(
    runc_server: StreamingServer, container: Container
) -> None:
    url = runc_server.get_portforward_url(api_pb2.PortForwardRequest(pod_sandbox_id="pod"))
    client = await SpdyClient.connect(url, [PORTFORWARD])
    try:
        request = b"GET / HTTP/1.0\r\nHost: pod\r\n\r\n"
        results = await asyncio.gather(
            *(
                spdy_forward_once(client, port, request_id, request)
                for request_id, port in enumerate([*HTTP_PORTS, *HTTP_PORTS, 9999])
            )
        )
    finally:
        await client.close()

    for (data, error), port in zip(results[:4], [*HTTP_PORTS, *HTTP_PORTS], strict=True):
        assert data.split(b"\r\n", 1)[0].endswith(b"200 OK"), data
        assert data.endswith(b"served from port %d\n" % port)
        assert error == b""
    refused_data, refused_error = results[4]
    assert refused_data == b""
    assert b"error forwarding port 9999" in refused_error


async def test_host_namespace_is_not_the_pods(
    runc_server: StreamingServer, container: Container
) -> None:
    # The pod's httpd is only inside its namespace: the host's loopback has nothing there,
    # so a success above really went through setns.
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", HTTP_PORTS[0])
