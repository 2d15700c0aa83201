"""The CRI socket's file (unix_socket.py): bound 0660 with its group, through a private
directory, in a directory only root can write to; and the private socket behind an
activated one."""

from __future__ import annotations

import grp
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from cri_shim.config import ConfigError
from cri_shim.transport.unix_socket import (
    bind_private_socket,
    bind_unix_socket,
    group_id,
    prepare_socket_dir,
)


@pytest.fixture
async def server() -> AsyncIterator[grpc.aio.Server]:
    bound = grpc.aio.server()
    yield bound
    await bound.stop(None)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_directory_others_could_write_to_is_refused(tmp_path: Path) -> None:
    prepare_socket_dir(tmp_path / "run" / "cri-shim")
    assert _mode(tmp_path / "run" / "cri-shim") == 0o755
    for mode, who in ((0o777, "others"), (0o775, "its group")):
        os.chmod(tmp_path / "run", mode)
        with pytest.raises(ConfigError, match=f"writable by {who} .* only root can write"):
            prepare_socket_dir(tmp_path / "run")


def test_the_socket_group_by_name_or_number() -> None:
    assert group_id("") is None
    assert group_id("1234") == 1234
    assert group_id(grp.getgrgid(0).gr_name) == 0
    with pytest.raises(ConfigError, match="socket_group: no group 'no-such-group'"):
        group_id("no-such-group")


async def test_the_socket_is_bound_with_its_mode_and_group_and_nothing_staged_stays(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    path = tmp_path / "cri-shim.sock"
    umask = os.umask(0)  # gRPC would make the socket 0777
    try:
        bind_unix_socket(server, path, group="1234")
    finally:
        os.umask(umask)
    assert stat.S_ISSOCK(path.stat().st_mode)
    assert _mode(path) == 0o660 and path.stat().st_gid == 1234
    assert os.listdir(tmp_path) == ["cri-shim.sock"]


async def test_a_file_in_the_sockets_place_is_refused(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    (tmp_path / "cri-shim.sock").write_text("not a socket")
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        bind_unix_socket(server, tmp_path / "cri-shim.sock")


async def test_the_private_socket_is_in_a_directory_only_root_enters(
    tmp_path: Path, server: grpc.aio.Server
) -> None:
    staged = bind_private_socket(server, tmp_path / "cri-shim.sock")
    assert staged.parent == tmp_path / f".grpc-{os.getpid()}"
    assert _mode(staged.parent) == 0o700
