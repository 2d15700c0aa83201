"""Socket activation's variables (LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES) and the choice
of the passed socket that is the CRI socket."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cri_shim.config import ConfigError
from cri_shim.transport.activation import PassedFd, choose_socket, passed_fds
from tests.harness import REPO, socket_activation


def environ(**variables: str) -> dict[str, str]:
    return {"PATH": "/bin", **variables}


def test_without_the_variables_nothing_was_passed() -> None:
    assert passed_fds(environ(), 42) == []


def test_the_variables_are_taken_out_whoever_they_were_for() -> None:
    variables = environ(LISTEN_PID="41", LISTEN_FDS="1", LISTEN_FDNAMES="cri-shim.socket")
    assert passed_fds(variables, 42) == []  # a parent's, inherited
    assert variables == environ()  # and not passed on to runc, conmon, plugins


def test_the_passed_descriptors_from_3_with_their_names() -> None:
    variables = environ(LISTEN_PID="42", LISTEN_FDS="2", LISTEN_FDNAMES="cri-shim.socket:extra")
    assert passed_fds(variables, 42) == [
        PassedFd(3, "cri-shim.socket"),
        PassedFd(4, "extra"),
    ]
    assert variables == environ()


@pytest.mark.parametrize(
    ("count", "names", "message"),
    [
        ("one", "", "LISTEN_FDS='one' is not a number"),
        ("2", "cri-shim.socket", "names 1 socket(s) (cri-shim.socket) but LISTEN_FDS=2"),
    ],
)
def test_variables_that_do_not_add_up_stop_the_start(count: str, names: str, message: str) -> None:
    variables = environ(LISTEN_PID="42", LISTEN_FDS=count, LISTEN_FDNAMES=names)
    with pytest.raises(ConfigError, match=re.escape(message)):
        passed_fds(variables, 42)


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(tmp_path / "cri.sock"))
        sock.listen()
        yield sock


def test_the_socket_on_the_configured_path_is_chosen(
    tmp_path: Path, listening: socket.socket
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as datagrams:
        fds = [PassedFd(datagrams.fileno(), "other"), PassedFd(listening.fileno(), "cri")]
        chosen, name = choose_socket(tmp_path / "cri.sock", fds)
        assert chosen.fileno() == listening.fileno() and name == "cri"
        # What the daemon starts does not inherit it.
        assert fcntl.fcntl(listening.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        chosen.detach()


def test_a_socket_on_another_path_is_refused_naming_both(
    tmp_path: Path, listening: socket.socket
) -> None:
    with pytest.raises(ConfigError) as refused:
        choose_socket(tmp_path / "elsewhere.sock", [PassedFd(listening.fileno(), "cri")])
    message = str(refused.value)
    assert f"listen is unix://{tmp_path}/elsewhere.sock" in message
    assert f"a listening unix stream socket on '{tmp_path}/cri.sock'" in message
    assert listening.fileno() >= 0  # still systemd's: not closed by the refusal


def test_a_socket_that_does_not_listen_is_refused(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(tmp_path / "cri.sock"))
        with pytest.raises(ConfigError, match=r"fd [0-9]+ \(cri\): a unix stream socket"):
            choose_socket(tmp_path / "cri.sock", [PassedFd(bound.fileno(), "cri")])


def test_a_descriptor_that_is_no_socket_is_refused(tmp_path: Path) -> None:
    with open(tmp_path / "file", "w") as file:
        with pytest.raises(ConfigError, match="not a socket"):
            choose_socket(tmp_path / "cri.sock", [PassedFd(file.fileno(), "file")])


def test_a_process_given_the_socket_as_systemd_does_takes_it(
    tmp_path: Path, listening: socket.socket
) -> None:
    """The whole path in a child process: descriptor 3, LISTEN_PID its own, the
    variables gone from its environment afterwards."""
    program = (
        "import os, pathlib, sys\n"
        "from cri_shim.transport.activation import activated_socket\n"
        "sock, _name = activated_socket(pathlib.Path(sys.argv[1]))\n"
        "print(sock.fileno(), sorted(k for k in os.environ if k.startswith('LISTEN_')))\n"
    )
    fd = listening.fileno()
    result = subprocess.run(
        [*socket_activation((fd,)), sys.executable, "-c", program, str(tmp_path / "cri.sock")],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "LISTEN_PID": "1"},
        check=True,
    )
    assert result.stdout.split(maxsplit=1) == ["3", "[]\n"]
