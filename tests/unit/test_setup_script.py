"""scripts/setup on a first run: it waits for apt's locks, and a start needs no network.

The script runs from a copy of the checkout's layout in tmp (its venv already made), with
fakes of apt-get, apt-cache and dpkg-query first on PATH: they log their calls, report
the packages the test says are missing, and refuse the first runs of apt-get as apt does
when another apt-get or dpkg holds a lock.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCKED = "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)"

FAKE_APT_GET = f"""#!/bin/bash
echo "$*" >> "$FAKES/apt-get.log"
runs=$(cat "$FAKES/runs" 2>/dev/null || echo 0)
echo $((runs + 1)) > "$FAKES/runs"
if [ "$runs" -lt "${{FAKE_LOCKED_RUNS:-0}}" ]; then
    echo "{LOCKED}" >&2
    exit 100
fi
"""
FAKE_APT_CACHE = """#!/bin/bash
for p in $FAKE_UNAVAILABLE; do [ "$p" = "${@: -1}" ] && exit 100; done
exit 0
"""
FAKE_DPKG_QUERY = """#!/bin/bash
for p in $FAKE_MISSING; do [ "$p" = "${@: -1}" ] && exit 1; done
echo "install ok installed"
"""


@dataclass
class Checkout:
    root: Path
    fakes: Path

    def setup(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.root / "scripts" / "setup"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={
                **os.environ,
                "PATH": f"{self.fakes}:{os.environ['PATH']}",
                "FAKES": str(self.fakes),
                **env,
            },
        )

    def apt_calls(self) -> list[str]:
        log = self.fakes / "apt-get.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup", root / "scripts" / "setup")
    (root / "pyproject.toml").write_text("")
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    (root / ".venv" / ".cri-shim-installed").touch()  # newer than pyproject.toml
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    for name, text in (
        ("apt-get", FAKE_APT_GET),
        ("apt-cache", FAKE_APT_CACHE),
        ("dpkg-query", FAKE_DPKG_QUERY),
    ):
        (fakes / name).write_text(text)
        (fakes / name).chmod(0o755)
    return Checkout(root, fakes)


def test_a_lock_held_by_another_apt_is_waited_for(checkout: Checkout) -> None:
    done = checkout.setup(FAKE_MISSING="crun", FAKE_LOCKED_RUNS="1")
    assert done.returncode == 0, done.stderr
    assert f"waiting up to 600s for another apt-get or dpkg: {LOCKED}" in done.stdout
    calls = checkout.apt_calls()
    assert [c.split()[-2:] for c in calls] == [
        ["update", "-q"],  # refused: the lists lock was held
        ["update", "-q"],
        ["--no-install-recommends", "crun"],
    ]
    # dpkg's own lock is waited for by apt itself.
    assert all(c.startswith("-o DPkg::Lock::Timeout=600 ") for c in calls), calls


def test_a_lock_held_past_the_timeout_fails_with_apts_message(checkout: Checkout) -> None:
    done = checkout.setup(FAKE_MISSING="crun", FAKE_LOCKED_RUNS="99", APT_LOCK_TIMEOUT="0")
    assert done.returncode == 100
    assert LOCKED in done.stderr
    assert len(checkout.apt_calls()) == 1


def test_an_unavailable_optional_package_is_looked_for_once(checkout: Checkout) -> None:
    first = checkout.setup(FAKE_MISSING="kubectl", FAKE_UNAVAILABLE="kubectl")
    assert first.returncode == 0, first.stderr
    assert "optional package kubectl is not available" in first.stdout
    assert checkout.apt_calls() == ["-o DPkg::Lock::Timeout=600 update -q"]
    again = checkout.setup(FAKE_MISSING="kubectl", FAKE_UNAVAILABLE="kubectl")
    assert again.returncode == 0, again.stderr
    assert checkout.apt_calls() == ["-o DPkg::Lock::Timeout=600 update -q"]  # no new call


def test_serves_setup_runs_no_apt_get_for_the_optional_packages(checkout: Checkout) -> None:
    done = checkout.setup("--no-optional", FAKE_MISSING="kubectl")
    assert done.returncode == 0, done.stderr
    assert checkout.apt_calls() == []
    serve = (REPO / "scripts" / "serve").read_text()
    assert "scripts/setup --no-optional\n" in serve
