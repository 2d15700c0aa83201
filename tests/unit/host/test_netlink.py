"""Netlink's library is loaded when a message is first sent, not with the daemon."""

from __future__ import annotations

import subprocess
import sys


def test_the_daemon_starts_without_pyroute2() -> None:
    """pyroute2 costs about 11 MiB resident: it is loaded by the first pod network."""
    code = "import sys, cri_shim.cli, cri_shim.daemon; print('pyroute2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
