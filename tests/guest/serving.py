"""Waiting for the installed daemon to serve, after its unit's start job has ended.

Behind cri-shim.socket the start job ends as soon as the daemon answers the socket, before
its state is restored (contrib/systemd/cri-shim.service); a test that times its first
calls waits for the status the daemon gives once it serves.
"""

from __future__ import annotations

import subprocess

from tests.waiting import wait_until

UNIT = "cri-shim"


def status_text(unit: str = UNIT) -> str:
    return subprocess.run(
        ["systemctl", "show", "-P", "StatusText", unit],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def wait_serving(unit: str = UNIT, timeout: float = 120) -> None:
    """Until the unit's daemon says it serves (STATUS=serving); scaled for the guest."""
    wait_until(lambda: status_text(unit) == "serving", timeout=timeout, interval=0.5)
