"""The CRI socket systemd hands over (socket activation, as sd_listen_fds(3) reads it).

With `cri-shim.socket`, systemd binds the CRI socket and holds it across restarts of the
service: kubelet's connections made while the daemon restarts or is upgraded wait in the
socket's backlog instead of being refused, and the daemon takes them once its state is
restored (transport/relay.py). The variables are taken out of the environment whatever they
say, so that nothing the daemon starts (runc, conmon, CNI and NRI plugins) takes the
sockets for its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import socket
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from cri_shim.config import ConfigError
from cri_shim.transport.http2_drain import settings_frame

log = logging.getLogger("cri_shim.transport.activation")

# The first file descriptor systemd passes (SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3


@dataclass(frozen=True)
class PassedFd:
    fd: int
    name: str  # LISTEN_FDNAMES' entry: the socket unit's name unless it set another


def passed_fds(environ: MutableMapping[str, str], pid: int) -> list[PassedFd]:
    """The descriptors systemd passed to process `pid`, taken out of `environ`.

    None when the variables are absent or were meant for another process (LISTEN_PID is
    not ours: a parent's, inherited), as sd_listen_fds(3) answers."""
    listen_pid = environ.pop("LISTEN_PID", None)
    count = environ.pop("LISTEN_FDS", None)
    names = environ.pop("LISTEN_FDNAMES", None)
    if count is None or listen_pid is None:
        return []
    if listen_pid.strip() != str(pid):
        log.info("LISTEN_FDS was meant for process %s, not this one: ignored", listen_pid)
        return []
    if not count.isdigit():
        raise ConfigError(f"socket activation: LISTEN_FDS={count!r} is not a number")
    listed = names.split(":") if names else []
    if listed and len(listed) != int(count):
        raise ConfigError(
            f"socket activation: LISTEN_FDNAMES names {len(listed)} socket(s) "
            f"({names}) but LISTEN_FDS={count}"
        )
    return [
        PassedFd(LISTEN_FDS_START + index, listed[index] if listed else "unknown")
        for index in range(int(count))
    ]


def activated_socket(
    expected: Path, environ: MutableMapping[str, str] | None = None
) -> tuple[socket.socket, str] | None:
    """The passed socket listening on `expected` (the configured `listen`) and its name
    (the socket unit's), or None when systemd passed none. A passed socket that cannot be
    the CRI socket stops the start with a message naming both sides: kubelet would
    otherwise wait on a socket nobody accepts on."""
    fds = passed_fds(os.environ if environ is None else environ, os.getpid())
    return choose_socket(expected, fds) if fds else None


def choose_socket(expected: Path, fds: list[PassedFd]) -> tuple[socket.socket, str]:
    """The one of `fds` listening on `expected`, with its name; ConfigError naming them
    all if none is."""
    found = []
    for passed in fds:
        # Not inherited by what the daemon starts, as sd_listen_fds(3) leaves them.
        flags = fcntl.fcntl(passed.fd, fcntl.F_GETFD)
        fcntl.fcntl(passed.fd, fcntl.F_SETFD, flags | fcntl.FD_CLOEXEC)
        found.append(_describe(passed))
        sock = _listening_unix_socket(passed)
        if sock is not None and sock.getsockname() == str(expected):
            log.info("socket activation: %s (%s) passed by systemd", expected, passed.name)
            return sock, passed.name
        if sock is not None:
            sock.detach()  # the descriptor stays systemd's to close
    raise ConfigError(
        f"socket activation: listen is unix://{expected} but systemd passed "
        f"{', '.join(found)}; make the socket unit's ListenStream= and the listen setting "
        "name the same path"
    )


def _listening_unix_socket(passed: PassedFd) -> socket.socket | None:
    try:
        sock = socket.socket(fileno=passed.fd)
    except OSError:
        return None  # not a socket
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM and listening:
        return sock
    sock.detach()
    return None


def _describe(passed: PassedFd) -> str:
    try:
        sock = socket.socket(fileno=passed.fd)
    except OSError as exc:
        return f"fd {passed.fd} ({passed.name}): not a socket ({exc.strerror})"
    try:
        kind = "a listening" if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) else "a"
        family = "unix stream" if sock.family == socket.AF_UNIX else sock.family.name
        if sock.family == socket.AF_UNIX and sock.type != socket.SOCK_STREAM:
            family = f"unix {sock.type.name}"
        return f"fd {passed.fd} ({passed.name}): {kind} {family} socket on {sock.getsockname()!r}"
    finally:
        sock.detach()


class EarlyAcceptor:
    """Accepts on the activated socket from the process's first moments, on a thread of
    its own, while the daemon's modules load (seconds on a slow machine, before the relay
    can run): each connection is answered HTTP/2's server preface at once (kubelet's gRPC
    closes a connection left unanswered 5 s, failing its calls) and kept, unread, for the
    relay, which takes them over (`take`) and accepts from then on. `unit` is the name
    systemd gave the socket (LISTEN_FDNAMES: its socket unit's, unless it set another)."""

    def __init__(self, listening: socket.socket, unit: str = "") -> None:
        self.listening = listening
        self.unit = unit
        listening.setblocking(False)
        self._accepted: list[socket.socket] = []
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="early-accept", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self.listening.fileno(), self._wake_read], [], [])
            if self._wake_read in ready:
                return
            try:
                connection, _ = self.listening.accept()
            except (BlockingIOError, InterruptedError):
                continue  # the client went away before the accept
            except OSError as exc:
                log.warning("socket activation: accepting early failed: %s", exc)
                return
            try:
                connection.setblocking(True)
                connection.sendall(settings_frame())
            except OSError:
                connection.close()
                continue
            self._accepted.append(connection)

    def take(self) -> list[socket.socket]:
        """Stop accepting; the connections accepted so far, each answered its preface."""
        os.write(self._wake_write, b"x")
        self._thread.join()
        os.close(self._wake_read)
        os.close(self._wake_write)
        taken, self._accepted = self._accepted, []
        return taken
