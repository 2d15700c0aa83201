"""Trace collectors that misbehave over TLS, for the exporter's tests: each serves a
connection from its first byte, the TLS handshake its to make or not. And the
self-signed certificate they (and other TLS tests) present."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

TlsAnswer = Callable[[socket.socket, ssl.SSLContext], None]


def self_signed(directory: Path, names: str = "IP:127.0.0.1,DNS:localhost") -> tuple[Path, Path]:
    """A certificate for `names` (a subjectAltName) and its key, in `directory`."""
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", f"subjectAltName={names}",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def serving(serve: Callable[[socket.socket], None]) -> Iterator[int]:
    """A listener on 127.0.0.1 whose connections `serve` serves, one at a time; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = listener.accept()
                with connection, contextlib.suppress(OSError):
                    serve(connection)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@contextlib.contextmanager
def tls_collector(answer: TlsAnswer, certificate: tuple[Path, Path]) -> Iterator[int]:
    """`serving` connections by `answer`, with `certificate` to present; its port."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(*certificate)
    with serving(lambda connection: answer(connection, server)) as port:
        yield port


def _trickle(send: Callable[[bytes], object], count: int = 200, every: float = 0.05) -> None:
    for _ in range(count):
        send(b"\0")
        time.sleep(every)


def handshake_never_ends(connection: socket.socket, _: ssl.SSLContext) -> None:
    """Takes the ClientHello, then sends a record header that promises 16 KiB of
    handshake and trickles them."""
    connection.recv(65536)
    connection.sendall(b"\x16\x03\x03\x40\x00")
    _trickle(connection.sendall)


def never_answers(connection: socket.socket, server: ssl.SSLContext) -> None:
    """Completes the handshake, reads the request as slowly as it likes, answers nothing."""
    with server.wrap_socket(connection, server_side=True) as tls:
        while tls.recv(1024):
            time.sleep(0.05)


def reads_and_answers_nothing(connection: socket.socket, _: ssl.SSLContext) -> None:
    """Plain HTTP: takes the request, answers nothing."""
    while connection.recv(65536):
        pass


def trickles_its_answer(connection: socket.socket, server: ssl.SSLContext) -> None:
    with server.wrap_socket(connection, server_side=True) as tls:
        tls.recv(65536)
        tls.sendall(b"HTTP/1.1 200 OK\r\n")
        _trickle(tls.sendall)


def answers(connection: socket.socket, server: ssl.SSLContext) -> None:
    with server.wrap_socket(connection, server_side=True) as tls:
        received = b""
        while b"\r\n\r\n" not in received:
            received += tls.recv(65536)
        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
