"""The daemon's readiness notification to systemd (Type=notify), and nothing it starts
seeing systemd's socket."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from cri_shim.config import Config
from cri_shim.daemon import Daemon
from cri_shim.host.sd_notify import SystemdNotifier


def test_the_notify_socket_reaches_systemd_and_no_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(address))
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(address))
        daemon = Daemon(Config())
        # runc given systemd's socket relays the container's readiness instead and
        # holds `runc start` until the container sends READY=1.
        assert "NOTIFY_SOCKET" not in os.environ
        child = subprocess.run(["env"], capture_output=True, text=True, check=True)
        assert "NOTIFY_SOCKET" not in child.stdout
        daemon.systemd.notify("READY=1")
        assert systemd.recv(64) == b"READY=1"


def test_an_abstract_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"cri-shim-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name)
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        Daemon(Config()).systemd.notify("STOPPING=1")
        assert systemd.recv(64) == b"STOPPING=1"


def test_without_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    Daemon(Config()).systemd.notify("READY=1")  # no socket: a no-op


def test_ready_is_sent_once_then_the_status_alone(tmp_path: Path) -> None:
    address = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(address))
        systemd.settimeout(5)
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(address)})
        notifier.ready("restoring")
        notifier.ready("serving")
        assert systemd.recv(64) == b"READY=1\nSTATUS=restoring"
        assert systemd.recv(64) == b"STATUS=serving"
