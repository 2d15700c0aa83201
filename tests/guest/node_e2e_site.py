"""The node e2e suite's runtime as a node runs it: the daemon installed by scripts/install as
its systemd unit (socket-activated; `cgroup_manager` left at `auto`, systemd's where
systemd is PID 1), for `scripts/node-e2e --as-installed-unit` in the cgroup v2 guest
(tests/guest/lane.sh, step `node-e2e`).

The installed configuration gets only what the runner may add to the daemon's defaults:
the local registry as the mirror of the specs' registries, and a `test-handler` runtime
handler (runc) for the RuntimeClass specs; it is put back as installed afterwards, and
the units are stopped. The suite finds the unit through the daemon's pid (its
`--container-runtime-pid-file` holds the unit's main pid): the Serial spec that stops
and starts the runtime does so with `systemctl` on that unit.
"""

from __future__ import annotations

import subprocess
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.guest.serving import wait_serving
from tests.harness import REPO

CONFIG = Path("/etc/cri-shim/config.toml")
SOCKET = Path("/run/cri-shim/cri-shim.sock")
UNIT = "cri-shim"
# kubelet's slices under systemd's cgroup driver, and the one systemd-run puts the suite's
# kubelet in: transient units that outlive the kubelet that made them.
KUBELET_SLICES = ("kubepods.slice", "runtime.slice")


def systemctl(*args: str, check: bool = True) -> str:
    return subprocess.run(
        ["systemctl", *args], check=check, capture_output=True, text=True, timeout=300
    ).stdout


def configured(installed: str, registry_host: str, mirrored: tuple[str, ...]) -> str:
    """The installed configuration with the registry as every mirrored registry's mirror
    and a `test-handler` handler beside `runc`: the rest as installed."""
    import tomli_w

    data = tomllib.loads(installed)
    images = data.setdefault("images", {})
    images["insecure_registries"] = [registry_host]
    images["mirrors"] = {name: [f"http://{registry_host}"] for name in mirrored}
    handlers = data.setdefault("runtime", {}).setdefault("handlers", {})
    handlers.setdefault("runc", {"path": "runc"})
    handlers["test-handler"] = {"path": "runc"}
    return tomli_w.dumps(data)


def main_pid() -> int:
    return int(systemctl("show", "--property=MainPID", "--value", UNIT).strip() or 0)


@contextmanager
def installed_unit(
    work: Path, registry_host: str, mirrored: tuple[str, ...], socket_activation: bool = True
) -> Iterator[Path]:
    """The installed, started unit (with cri-shim.socket unless `socket_activation` is
    false); yields the pid file the suite reads (the unit's main pid). Stops the units and
    the kubelet's slices, and puts the configuration back, after."""
    install = [str(REPO / "scripts" / "install"), "--venv", str(REPO / ".venv")]
    if not socket_activation:
        install.append("--no-socket-activation")
    subprocess.run(install, check=True, timeout=300)
    installed = CONFIG.read_text()
    CONFIG.write_text(configured(installed, registry_host, mirrored))
    since = f"@{int(time.time())}"
    try:
        systemctl("start", UNIT)  # Type=notify: returns once the daemon answers the socket
        wait_serving(UNIT)
        pid_file = work / "cri-shim.pid"
        pid_file.write_text(str(main_pid()))  # no newline: the suite's Atoi takes none
        yield pid_file
    finally:
        systemctl("stop", UNIT, f"{UNIT}.socket", check=False)
        for name in KUBELET_SLICES:
            systemctl("stop", name, check=False)
        CONFIG.write_text(installed)
        journal = subprocess.run(
            ["journalctl", "-u", UNIT, "--no-pager", "-o", "short-precise", "--since", since],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        (REPO / ".cache" / "node-e2e" / "daemon.log").write_text(journal)
