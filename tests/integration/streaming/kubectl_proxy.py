"""A stand-in API server so that the real kubectl can drive the streaming server.

kubectl talks to an API server, which (through kubelet) proxies exec, attach and
port-forward upgrades to the runtime's streaming URL. This stand-in answers the pod GET
that kubectl makes first, and passes the upgrade request through to the streaming URL the
test chose, byte for byte except the request line. kubectl's SPDY and WebSocket code (Go's
spdystream and gorilla/websocket) is then an independent client of our server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

KUBECTL = shutil.which("kubectl")
POD = "streamed"
NAMESPACE = "default"


def _pod_json() -> bytes:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": POD, "namespace": NAMESPACE, "uid": "0000-test"},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            "status": {
                "phase": "Running",
                "containerStatuses": [{"name": "main", "ready": True, "state": {"running": {}}}],
            },
        }
    ).encode()


_SUBRESOURCE_VERBS = ["create", "get"]
# Just enough discovery for kubectl to map "pod" to the core v1 pods resource.
DISCOVERY: dict[str, object] = {
    "/version": {"major": "1", "minor": "32", "gitVersion": "v1.32.0"},
    "/api": {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
    },
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
    "/api/v1": {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": "pods",
                "singularName": "pod",
                "namespaced": True,
                "kind": "Pod",
                "verbs": ["get", "list"],
                "shortNames": ["po"],
            },
            *(
                {
                    "name": f"pods/{sub}",
                    "singularName": "",
                    "namespaced": True,
                    "kind": kind,
                    "verbs": _SUBRESOURCE_VERBS,
                }
                for sub, kind in (
                    ("exec", "PodExecOptions"),
                    ("attach", "PodAttachOptions"),
                    ("portforward", "PodPortForwardOptions"),
                )
            ),
        ],
    },
}


@dataclass
class FakeApiServer:
    """Routes `/api/v1/namespaces/default/pods/streamed/{exec,attach,portforward}` to `target`."""

    target: str = ""  # the streaming URL the next upgrade goes to
    server: asyncio.Server | None = None
    requests: list[str] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                    "current-context": "test",
                }
            )
        )
        return path

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, _, rest = head.partition(b"\r\n")
            method, target, version = request_line.decode().split(" ")
            self.requests.append(f"{method} {target}")
            path = urlsplit(target).path
            pod_path = f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}"
            if path in DISCOVERY or (path == pod_path and method == "GET"):
                body = _pod_json() if path == pod_path else json.dumps(DISCOVERY[path]).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
            elif path.startswith(pod_path + "/") and self.target:
                await self._proxy(method, version, rest, reader, writer)
            else:
                writer.write(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    async def _proxy(
        self,
        method: str,
        version: str,
        rest: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        upstream = urlsplit(self.target)
        up_reader, up_writer = await asyncio.open_connection(upstream.hostname, upstream.port)
        up_writer.write(f"{method} {upstream.path} {version}\r\n".encode() + rest)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.write_eof()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            up_writer.close()


def kubectl(kubeconfig: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    assert KUBECTL is not None
    return [KUBECTL, "--kubeconfig", str(kubeconfig), "--request-timeout=20s", *args]


def run_kubectl_blocking(
    argv: list[str], stdin: bytes, env: dict[str, str]
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, input=stdin, capture_output=True, env=env, timeout=60, check=False)
