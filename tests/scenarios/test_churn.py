"""Churn: 200 pods that live two seconds, 8 at a time, with and without a kill -9 midway.

At no moment may two live pods share an IP or a name, and when the churn stops nothing may
be left: no netns, veth, IPAM allocation, mount, conmon, runc container or row.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.churn import Churn, restart_midway
from tests.harness import Daemon, import_image

pytestmark = [pytest.mark.integration, pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]


def _assert_nothing_left(daemon: Daemon) -> None:
    assert daemon.leaks() == {}, daemon.log()
    runc = subprocess.run(
        ["runc", "--root", str(daemon.run_root / "runtime" / "runc"), "list", "-q"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert runc == []
    conmons = subprocess.run(
        ["pgrep", "-f", f"conmon.*{daemon.run_root}"], capture_output=True, text=True, check=False
    ).stdout.split()
    assert conmons == []


def test_churn_of_short_lived_pods(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)
    report = Churn(daemon).run(pods=200, parallel=8)
    assert report.errors == []
    assert report.conflicts == []
    assert len(report.pod_to_running) == 200
    _assert_nothing_left(daemon)


def test_churn_with_a_kill9_midway(daemon: Daemon, busybox_layout: Path) -> None:
    import_image(daemon, busybox_layout)
    report = Churn(daemon).run(pods=200, parallel=8, during=restart_midway(at=100))
    assert report.errors == []
    assert report.conflicts == []
    _assert_nothing_left(daemon)
