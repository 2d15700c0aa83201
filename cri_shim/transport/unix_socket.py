"""The CRI socket's file: created 0660, owned by root and `socket_group`, in a
directory nobody else can write to.

Whoever can connect to the socket can run containers as root, so:
- The directory must not be writable by its group or others, nor owned by another user:
  any of them could replace the socket with their own between two of our steps, or after
  them.
- gRPC creates the socket with the process umask's mode, and only afterwards could we
  chmod it; a client that connected in between would keep its connection. So the socket
  is bound in a private (0700) directory beside the final path, given its mode and group
  there, and only then renamed into place: it is never reachable with the wrong mode.
"""

from __future__ import annotations

import grp
import os
import shutil
import stat
from pathlib import Path

import grpc

from cri_shim.config import ConfigError

SOCKET_MODE = 0o660


def prepare_socket_dir(directory: Path) -> None:
    """Create the socket's directory (0755) or check that an existing one is safe."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "others" if info.st_mode & stat.S_IWOTH else "its group"
        raise ConfigError(
            f"listen: the socket's directory {directory} is writable by {who} (mode "
            f"{stat.S_IMODE(info.st_mode):o}): they could replace the socket; use a "
            "directory only root can write to, such as /run/cri-shim"
        )
    if info.st_uid not in (0, os.geteuid()):
        raise ConfigError(
            f"listen: the socket's directory {directory} belongs to uid {info.st_uid}, "
            "who could replace the socket; use a directory owned by root"
        )


def group_id(group: str) -> int | None:
    """The gid of `socket_group` (a name or a number); None for "" (keep root's)."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"socket_group: no group {group!r} on this host") from None


def bind_unix_socket(server: grpc.aio.Server, path: Path, group: str = "") -> None:
    """Bind `server` to the unix socket `path` (mode 0660, group `group`); see the
    module docstring for why it goes through a private directory."""
    gid = group_id(group)
    prepare_socket_dir(path.parent)
    # A socket file left by a previous run would make the rename replace it, which is
    # what we want; anything else there is a mistake in the configuration.
    if path.exists() and not path.is_socket():
        raise ConfigError(f"listen: {path} exists and is not a socket")
    # Short names: the staged path must fit in a socket address (108 bytes) too.
    private = path.parent / f".bind-{os.getpid()}"
    try:
        _make_private_dir(private)
        staged = private / "s"
        server.add_insecure_port(f"unix:{staged}")
        os.chmod(staged, SOCKET_MODE)
        if gid is not None:
            os.chown(staged, -1, gid)
        os.replace(staged, path)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def private_socket_dir(path: Path) -> Path:
    """Where the gRPC server listens behind an activated socket: beside the CRI socket,
    in a directory only root can enter (a short name: the path must fit in a socket
    address)."""
    return path.parent / f".grpc-{os.getpid()}"


def bind_private_socket(server: grpc.aio.Server, path: Path) -> Path:
    """Bind `server` to a socket only this daemon reaches, for the relay from the socket
    systemd passed (transport/relay.py): the CRI socket's mode and group are the socket
    unit's, and the private one is never reachable by anyone else. Returns its path;
    the caller removes `private_socket_dir(path)` when the server has stopped."""
    prepare_socket_dir(path.parent)
    private = private_socket_dir(path)
    _make_private_dir(private)
    staged = private / "s"
    server.add_insecure_port(f"unix:{staged}")
    return staged


def _make_private_dir(directory: Path) -> None:
    """A fresh 0700 directory (whatever the umask), a stale one from a pid reused gone."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700)
    os.chmod(directory, 0o700)
