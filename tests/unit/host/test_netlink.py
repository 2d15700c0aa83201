"""The daemon needs no netlink library, at start or for a pod's network."""

from __future__ import annotations

import subprocess
import sys


def test_the_daemon_starts_without_pyroute2() -> None:
    """pyroute2 costs about 11 MiB resident; `lo` is brought up without it."""
    code = (
        "import sys, cri_shim.cli, cri_shim.daemon, cri_shim.network.netns;"
        " print('pyroute2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
