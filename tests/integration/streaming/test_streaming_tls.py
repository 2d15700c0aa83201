"""The streaming server over TLS (`[streaming] tls_cert`/`tls_key`): the URLs are https,
the server speaks TLS with the configured certificate, and a pair that cannot be loaded
stops the start with one line rather than failing every Exec later."""

from __future__ import annotations

import socket
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from cri_shim.api.v1 import api_pb2
from tests.collectors import self_signed
from tests.harness import Daemon
from tests.integration.cri_testkit import container_config, create, import_image, pod, start

pytestmark = [pytest.mark.integration, pytest.mark.root]

EXIT_CONFIG = 2


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    return self_signed(tmp_path, "IP:127.0.0.1")


def _upgrade_over_tls(url: str, cert: Path) -> bytes:
    """The first line the server answers a SPDY upgrade with, over TLS that trusts
    only `cert`."""
    parts = urlsplit(url)
    context = ssl.create_default_context(cafile=str(cert))
    assert parts.hostname is not None and parts.port is not None
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as raw:
        with context.wrap_socket(raw, server_hostname=parts.hostname) as tls:
            tls.sendall(
                f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                "Connection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
                "X-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n".encode()
            )
            return tls.recv(4096).split(b"\r\n", 1)[0]


def test_exec_urls_are_served_over_tls(
    make_daemon: type, certificate: tuple[Path, Path], busybox_layout: Path, short_tmp: Path
) -> None:
    cert, key = certificate
    daemon: Daemon = make_daemon(
        settings={"streaming": {"tls_cert": str(cert), "tls_key": str(key)}}
    )
    daemon.start()
    import_image(daemon, busybox_layout)
    with pod(daemon, "tls", short_tmp) as p:
        container_id = create(daemon, p, container_config("sleeper", "sleep 60"))
        start(daemon, container_id)
        request = api_pb2.ExecRequest(container_id=container_id, cmd=["true"], stdout=True)
        url = daemon.runtime().Exec(request, timeout=30).url
        assert url.startswith("https://127.0.0.1:"), url
        assert _upgrade_over_tls(url, cert) == b"HTTP/1.1 101 Switching Protocols"
        # Plain HTTP is not served beside it.
        plain = urlsplit(url)
        assert plain.hostname is not None and plain.port is not None
        with socket.create_connection((plain.hostname, plain.port), timeout=30) as raw:
            raw.sendall(f"POST {plain.path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert not raw.recv(4096).startswith(b"HTTP/1.1 101")


def test_a_certificate_that_cannot_be_loaded_stops_the_start(
    make_daemon: type, certificate: tuple[Path, Path], tmp_path: Path
) -> None:
    cert, _ = certificate
    wrong_key = tmp_path / "other.key"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(wrong_key)],
        check=True,
        capture_output=True,
    )
    daemon: Daemon = make_daemon(
        settings={"streaming": {"tls_cert": str(cert), "tls_key": str(wrong_key)}}
    )
    daemon.start(wait=False)
    assert daemon.proc is not None
    assert daemon.proc.wait(timeout=60) == EXIT_CONFIG
    log = daemon.log()
    assert "Traceback" not in log
    (line,) = [text for text in log.splitlines() if "streaming.tls_cert" in text]
    assert str(cert) in line and str(wrong_key) in line
    assert not daemon.socket.exists()
